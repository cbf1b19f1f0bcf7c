"""The same work units on a local Ray cluster (``ray.init(num_cpus=2)``), when Ray is installed; and
one line when ``--ray`` is given without it."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import onnx_qat
from onnx_qat.errors import DataError, WorkerError
from tests.builders import outlier_channel_model, residual_block_model
from tests.onnx_qat.test_workers import SquareJob
from tests.reliability import support


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -c constraints.txt '.[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(support.ROOT)}})
    try:
        yield ray
    finally:
        ray.shutdown()


def _images(n: int, seed: int, size: int = 8, channels: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, channels, size, size)).astype(np.float32)


def test_ray_actors_answer_in_order_and_surface_errors(ray_cluster):
    from onnx_qat.runtime.ray_workers import RayPool

    with RayPool(SquareJob(offset=1), workers=2, address=True, name="units") as pool:
        assert pool.workers == 2
        results = pool.map([(k, 0.1 if k < 2 else 0.0) for k in range(8)])
        assert [r[0] for r in results] == [k * k + 1 for k in range(8)]
        assert len({r[1] for r in results}) == 2  # two actors, two processes
        with pytest.raises(DataError, match=r"^key 'x' is missing$"):
            pool.map([(1, 0), ("data-error", 0)])
    with RayPool(SquareJob(), workers=2, address=True, name="units") as pool:
        with pytest.raises(WorkerError,
                           match=r"units: Ray actor \d of 2 failed \(unit 2\): ValueError: bad unit"):
            pool.map([(1, 0), ("value-error", 0)])
    assert ray_cluster.is_initialized()  # a cluster the caller started is left running


def test_sensitivity_and_calibration_on_ray_match_one_process(ray_cluster):
    model = outlier_channel_model("conv2", seed=4)
    data = {"input": _images(24, 4)}
    one = onnx_qat.sensitivity(model, data, progress=False, workers=1)
    on_ray = onnx_qat.sensitivity(model, data, progress=False, ray=True, workers=2)
    assert one == on_ray and one.runs == on_ray.runs
    assert [s.only.cosine for s in one.sites] == [s.only.cosine for s in on_ray.sites]
    model = residual_block_model(projection=True)
    data = {"input": _images(40, 5)}
    for method in ("max", "entropy"):
        local = onnx_qat.calibrate(model, data, method=method, batch_size=4, workers=1, progress=False)
        remote = onnx_qat.calibrate(model, data, method=method, batch_size=4, ray=True, progress=False)
        assert local.activations == remote.activations, method


def test_ray_missing_is_one_line_and_exit_2(tmp_path):
    support.save(residual_block_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=_images(8, 1))
    code = ("import sys; sys.modules['ray'] = None; from onnx_qat.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "sensitivity", "m.onnx", "--data", "d.npz", "--ray",
                           "--no-progress"], cwd=tmp_path, env=support.cli_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["onnx-qat: error: --ray needs Ray, which is not installed: pip install 'onnx-qat[ray]' "
                     "(pinned in constraints.txt)"], proc.stderr
    with pytest.raises(onnx_qat.ConfigError, match="ray must be True or a Ray cluster address"):
        onnx_qat.calibrate(residual_block_model(), {"input": _images(4, 1)}, ray=3, progress=False)


def test_an_address_nothing_listens_on_is_one_line_at_once(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -c constraints.txt '.[ray]')")
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(WorkerError, match=rf"^cannot connect to the Ray cluster at 127.0.0.1:{port}: "):
        onnx_qat.calibrate(residual_block_model(), {"input": _images(8, 1)}, ray=f"127.0.0.1:{port}",
                           workers=2, batch_size=2, progress=False)


def test_a_model_after_ray_is_explained(capsys):
    from onnx_qat.cli import EXIT_USAGE, main

    assert main(["sensitivity", "--ray", "m.onnx", "--data", "d.npz"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--ray takes an optional ADDRESS, so give the model before it (or write --ray=ADDRESS)" in err


def test_the_processes_a_started_cluster_leaves_are_found_below_its_roots_and_killed():
    """What ``connect`` started is recorded as the children this process did not have before; at the
    close everything below them is killed, grandchildren that outlive their parent included (the
    raylet's agents), and a process that is not the one recorded (another start time) is left alone.
    No Ray needed: plain processes stand in for the cluster's."""
    import os
    import time

    from onnx_qat.runtime.ray_workers import _ClusterProcesses

    bystander = subprocess.Popen(["sleep", "60"])
    try:
        before = _ClusterProcesses.children()
        assert bystander.pid in before
        # a "raylet" with two "agents", and a second root
        raylet = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
        other = subprocess.Popen(["sleep", "60"])
        deadline = time.monotonic() + 10
        while len(support.descendants(raylet.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        agents = support.descendants(raylet.pid)
        started = _ClusterProcesses(before)
        assert set(started.roots) == {raylet.pid, other.pid}
        tree = started.tree()
        assert set(tree) == {raylet.pid, other.pid, *agents} and len(agents) == 2
        stale = dict(tree)
        stale[other.pid] = "0"  # recorded with another start time: a different process, not killed
        _ClusterProcesses.kill(stale)
        assert raylet.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while any(support.alive(p) for p in agents) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(support.alive(p) for p in agents)
        assert other.poll() is None and bystander.poll() is None
        other.kill()
        other.wait()
        assert os.getpid() not in tree
    finally:
        bystander.kill()
        bystander.wait()


API_CALL = r"""
import json, sys, numpy as np, onnx_qat, ray
from onnx_qat.runtime.ray_workers import _ClusterProcesses
model, data = sys.argv[1], {"input": np.load(sys.argv[2])["input"]}
before = set(_ClusterProcesses.children())
result = onnx_qat.sensitivity(model, data, ray=True, workers=2, batch_size=8, progress=False)
local = onnx_qat.sensitivity(model, data, workers=1, batch_size=8, progress=False)
left = set(_ClusterProcesses.children()) - before
print(json.dumps({"initialized": ray.is_initialized(), "children": len(left),
                  "same": [s.site.name for s in result.sites] == [s.site.name for s in local.sites]
                  and [s.only for s in result.sites] == [s.only for s in local.sites]}))
"""


def test_an_api_call_starts_its_local_cluster_and_leaves_nothing_behind(tmp_path):
    """``sensitivity(..., ray=True)`` in a process without Ray started: the call's calibration and
    settings run on the local cluster it starts (on a thread of its own, `ray_workers._Starter`), and
    when it returns Ray is shut down and none of the cluster's processes is a child of the caller any
    more; the results are those of one process."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -c constraints.txt '.[ray]')")
    import json

    support.save(residual_block_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=_images(32, 3))
    env = support.cli_env()
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", API_CALL, "m.onnx", "d.npz"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer == {"initialized": False, "children": 0, "same": True}, answer
