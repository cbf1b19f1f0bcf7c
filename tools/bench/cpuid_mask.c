/* cpuid_mask.c: make this process's CPUID report an x86 CPU without AVX-512, VNNI and AMX.
 *
 * Loaded with LD_PRELOAD (built by tools/bench/isa.py). Its constructor turns on CPUID faulting for
 * the thread (Linux arch_prctl(ARCH_SET_CPUID, 0), needs the CPU's "cpuid_fault" flag); threads
 * created later inherit the setting (it is cleared on execve, so a child process needs the library
 * again, which LD_PRELOAD in its environment gives it). Each CPUID instruction then raises SIGSEGV;
 * the handler here checks that the faulting instruction is CPUID (0F A2), lets this thread run the
 * real instruction once with the saved EAX/ECX, clears the feature bits listed below, writes
 * EAX..EDX into the interrupted context and moves RIP past the instruction. Any other SIGSEGV goes
 * to the handler that was there before (or the default action).
 *
 * What it cannot mask: XGETBV (XCR0 still says the OS saves AVX-512 and AMX state) and glibc's own
 * choice of string functions, made by ld.so before any constructor runs. onnxruntime's MLAS tests
 * the CPUID feature bit before XCR0 for every AVX-512 and AMX kernel (platform.cpp), so the CPUID
 * bits decide which kernels it runs.
 *
 * Bit positions: Intel SDM vol. 2A, CPUID leaf 07H; the same in Linux
 * arch/x86/include/asm/cpufeatures.h (words 9, 16, 18: leaf 7 subleaf 0 EBX, ECX, EDX) and GCC's
 * cpuid.h (bit_AVX512F ..., bit_AVXVNNI, bit_AVX512BF16 for leaf 7 subleaf 1 EAX).
 *
 * ONNX_QAT_CPUID_MASK selects what is cleared:
 *   "avx2"      (default) an AVX2 CPU without any VNNI: AVX-512 (all), AVX-VNNI, AMX and the other
 *               VEX extensions of later cores (AVX-IFMA, AVX-VNNI-INT8/INT16, AVX-NE-CONVERT);
 *   "avx2-vnni" the same but AVX-VNNI kept: an AVX2 CPU with VEX-encoded VNNI (Alder Lake class);
 *   "off"       nothing: CPUID runs as it is (state 0), for a reference reading in the same way.
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define BIT(n) (1u << (n))

/* leaf 7 subleaf 0 EBX: AVX512F 16, DQ 17, IFMA 21, PF 26, ER 27, CD 28, BW 30, VL 31 */
#define L7_EBX (BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31))
/* leaf 7 subleaf 0 ECX: VBMI 1, VBMI2 6, VNNI 11, BITALG 12, VPOPCNTDQ 14 */
#define L7_ECX (BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14))
/* leaf 7 subleaf 0 EDX: 4VNNIW 2, 4FMAPS 3, VP2INTERSECT 8, AMX-BF16 22, FP16 23, AMX-TILE 24,
 * AMX-INT8 25 */
#define L7_EDX (BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25))
/* leaf 7 subleaf 1 EAX: AVX-VNNI 4 (only in "avx2"), AVX512-BF16 5, AMX-FP16 21, AVX-IFMA 23 */
#define L71_EAX_VNNI BIT(4)
#define L71_EAX (BIT(5) | BIT(21) | BIT(23))
/* leaf 7 subleaf 1 EDX: AVX-VNNI-INT8 4, AVX-NE-CONVERT 5, AMX-COMPLEX 8, AVX-VNNI-INT16 10,
 * AVX10 19 (its leaf 24H is then zeroed too) */
#define L71_EDX (BIT(4) | BIT(5) | BIT(8) | BIT(10) | BIT(19))

static struct sigaction previous;
static int keep_avx_vnni;
static volatile int state;            /* 1: faulting on; -1: sigaction failed, -2: arch_prctl failed */
static volatile unsigned long traps;  /* CPUID instructions handled */

static long set_cpuid(int enabled) {
    return syscall(SYS_arch_prctl, ARCH_SET_CPUID, enabled);
}

static void real_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    if (leaf == 7 && sub == 0) {
        r[1] &= ~L7_EBX;
        r[2] &= ~L7_ECX;
        r[3] &= ~L7_EDX;
    } else if (leaf == 7 && sub == 1) {
        r[0] &= ~(L71_EAX | (keep_avx_vnni ? 0u : L71_EAX_VNNI));
        r[3] &= ~L71_EDX;
    } else if (leaf == 0x24) {
        r[0] = r[1] = r[2] = r[3] = 0;
    }
}

static void on_segv(int sig, siginfo_t *info, void *raw) {
    ucontext_t *uc = (ucontext_t *)raw;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (info->si_code == SI_KERNEL && ip[0] == 0x0F && ip[1] == 0xA2) {
        uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
        set_cpuid(1);
        real_cpuid(leaf, sub, r);
        set_cpuid(0);
        mask(leaf, sub, r);
        g[REG_RAX] = r[0];
        g[REG_RBX] = r[1];
        g[REG_RCX] = r[2];
        g[REG_RDX] = r[3];
        g[REG_RIP] += 2;
        traps++;
        return;
    }
    /* not ours: give the signal back to whoever had it, and let the instruction fault again */
    sigaction(SIGSEGV, &previous, NULL);
    (void)sig;
}

__attribute__((constructor)) static void cpuid_mask_start(void) {
    const char *which = getenv("ONNX_QAT_CPUID_MASK");
    struct sigaction act;
    if (which != NULL && strcmp(which, "off") == 0)
        return;
    keep_avx_vnni = which != NULL && strcmp(which, "avx2-vnni") == 0;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_segv;
    act.sa_flags = SA_SIGINFO;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGSEGV, &act, &previous) != 0) {
        state = -1;
        return;
    }
    if (set_cpuid(0) != 0) {
        sigaction(SIGSEGV, &previous, NULL);
        state = -2;
        return;
    }
    state = 1;
}

/* For tests and reports (ctypes): the CPUID instruction itself, so in a masked process it traps and
 * returns the masked bits; the library's state (1 masking, < 0 failed, 0 not started); the traps so
 * far; and which mask is applied (1 when AVX-VNNI is kept). */
int onnx_qat_cpuid(uint32_t leaf, uint32_t sub, uint32_t *out) {
    real_cpuid(leaf, sub, out);
    return state;
}

int onnx_qat_cpuid_mask_state(void) { return state; }

unsigned long onnx_qat_cpuid_traps(void) { return traps; }

int onnx_qat_cpuid_keeps_avx_vnni(void) { return keep_avx_vnni; }
