// What the AMX micro-kernel's tile step costs on this CPU, one core, operands in L1: the
// 2 × 2 step of `multihead_kernels::bf16gemm::amx::micro_amx` (four tile loads, four
// `tdpbf16ps`) with and without the stores that end each 32 × 32 block of `C`.
//
//     cc -O2 -mamx-tile -mamx-bf16 -mavx512f tools/amx_tile_costs.c -o target/amx_tile_costs
//     target/amx_tile_costs
//
// Prints GFLOP/s (one core) for blocks of 4, 8 and 16 tile steps (a depth of 128, 256, 512):
//   no loads        the four products alone, as peak.c's loop;
//   loads           the four loads and four products, no block ends (C kept in the tiles);
//   zero            each block starts from tilezero, nothing stored;
//   one store       each block ends in one tile store;
//   four stores     each block ends in four tile stores (the kernel's pattern, without zeroing);
//   kernel          tilezero, the steps, four stores: what micro_amx does per half;
//   pipelined       the next block's first loads and products between this block's stores;
//   oneDNN order    oneDNN's AMX brgemm order (jit_brgemm_amx_uker, interleaved tile stores):
//                   C0 and C1 stored and zeroed right after their last products, C2 and C3
//                   between the next block's first products.
//   B from L2       the kernel's pattern with A in L1 and each block's B half-panel the next
//                   one of a 1 MiB buffer (L2), loaded with tileloaddt1: the driver's order at
//                   a depth of 512 with the A strip kept in L1;
//   A and B in L2   the same with each block's A strip the next one of a 512 KiB buffer too.
//   vector work     AVX-512 work alone, as much per step as `with vectors` adds (8 independent
//                   chains of 8 FMAs on 16 lanes, about 64 FMA slots), timed as if it were the
//                   kernel's blocks (so its figure is comparable: higher is cheaper);
//   with vectors    the kernel's blocks (operands in L1) with that work between the steps, as
//                   the driver runs the previous tile's epilogue: the tiles and the vector
//                   units overlap if this stays near `kernel`;
//   p0 work, with p0 work   the same with the exp's and the reciprocal's instructions
//                   (vscalefps, vrcp14ps, vrndscaleps: 8 chains of 8) instead of FMAs.
// Linux only (asks for the tile state with arch_prctl); exits with a message without AMX.

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tilecfg;

#define MAX_STEPS 16
#define LDA (32 * MAX_STEPS + 32) // bf16 elements per row of A, one line of padding
static uint16_t A[32 * LDA] __attribute__((aligned(64)));
static uint32_t B[MAX_STEPS * 16 * 64] __attribute__((aligned(64))); // 64 columns of pairs
static float C[8][32 * 64] __attribute__((aligned(64)));
// 16 panels of 64 columns at the deepest depth (1 MiB), and 16 strips of A (544 KiB).
#define PANELS 16
static uint32_t BIG_B[PANELS][MAX_STEPS * 16 * 64] __attribute__((aligned(64)));
static uint16_t BIG_A[PANELS][32 * LDA] __attribute__((aligned(64)));

#define LOAD_STEP(s)                                                   \
    _tile_loadd(4, A + 32 * (s), 2 * LDA);                             \
    _tile_loadd(5, A + 16 * LDA + 32 * (s), 2 * LDA);                  \
    _tile_loadd(6, B + (s) * 16 * 64, 256);                            \
    _tile_loadd(7, B + (s) * 16 * 64 + 16, 256);
#define PRODUCTS                                                        \
    _tile_dpbf16ps(0, 4, 6);                                           \
    _tile_dpbf16ps(1, 4, 7);                                           \
    _tile_dpbf16ps(2, 5, 6);                                           \
    _tile_dpbf16ps(3, 5, 7);
#define STORE(t, c) _tile_stored(t, (c) + ((t) / 2) * 16 * 64 + ((t) % 2) * 16, 256)

// oneDNN's step order (A0, B0, B1, C0, A1, C1, C2, C3), each C tile stored and zeroed right
// after its last product (C0, C1) or between the next block's first products (C2, C3).
#define ONEDNN_STEP(s, last, first)                                     \
    _tile_loadd(4, A + 32 * (s), 2 * LDA);                             \
    _tile_loadd(6, B + (s) * 16 * 64, 256);                            \
    _tile_loadd(7, B + (s) * 16 * 64 + 16, 256);                       \
    _tile_dpbf16ps(0, 4, 6);                                           \
    if (last) { STORE(0, c); _tile_zero(0); }                          \
    _tile_loadd(5, A + 16 * LDA + 32 * (s), 2 * LDA);                  \
    if (first) { STORE(2, cp); _tile_zero(2); }                        \
    _tile_dpbf16ps(1, 4, 7);                                           \
    if (last) { STORE(1, c); _tile_zero(1); }                          \
    if (first) { STORE(3, cp); _tile_zero(3); }                        \
    _tile_dpbf16ps(2, 5, 6);                                           \
    _tile_dpbf16ps(3, 5, 7);

enum { NO_LOADS, LOADS, ZERO, ONE_STORE, FOUR_STORES, KERNEL, PIPELINED, ONEDNN, B_L2, AB_L2,
       VECTORS, WITH_VECTORS, P0, WITH_P0, VARIANTS };
static const char *NAMES[] = {"no loads", "loads", "zero", "one store", "four stores", "kernel",
                              "pipelined", "oneDNN order", "B from L2", "A and B in L2",
                              "vector work", "with vectors", "p0 work", "with p0 work"};
static volatile float SINK;

// About 64 FMA slots of AVX-512 work: 8 independent chains of 8 dependent FMAs, in registers.
#define FMA8(m, a) \
    a0 = _mm512_fmadd_ps(a0, m, a); a1 = _mm512_fmadd_ps(a1, m, a); \
    a2 = _mm512_fmadd_ps(a2, m, a); a3 = _mm512_fmadd_ps(a3, m, a); \
    a4 = _mm512_fmadd_ps(a4, m, a); a5 = _mm512_fmadd_ps(a5, m, a); \
    a6 = _mm512_fmadd_ps(a6, m, a); a7 = _mm512_fmadd_ps(a7, m, a);
#define VECTOR_WORK(m, a) FMA8(m, a) FMA8(m, a) FMA8(m, a) FMA8(m, a) \
    FMA8(m, a) FMA8(m, a) FMA8(m, a) FMA8(m, a)
#define SC8(a) \
    a0 = _mm512_scalef_ps(a0, a); a1 = _mm512_scalef_ps(a1, a); \
    a2 = _mm512_scalef_ps(a2, a); a3 = _mm512_scalef_ps(a3, a); \
    a4 = _mm512_rcp14_ps(a4); a5 = _mm512_rcp14_ps(a5); \
    a6 = _mm512_roundscale_ps(a6, 0); a7 = _mm512_roundscale_ps(a7, 0);
#define P0_WORK(a) SC8(a) SC8(a) SC8(a) SC8(a) SC8(a) SC8(a) SC8(a) SC8(a)

// The kernel's half (tilezero, the steps, four stores) on A strip `a` and the B half-panel at
// `b` (pair rows 256 bytes apart), B loaded with tileloaddt1 as micro_amx loads it.
static inline void streamed_half(const uint16_t *a, const uint32_t *b, float *c, int steps) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int s = 0; s < steps; s++) {
        _tile_loadd(4, a + 32 * s, 2 * LDA);
        _tile_loadd(5, a + 16 * LDA + 32 * s, 2 * LDA);
        _tile_stream_loadd(6, b + s * 16 * 64, 256);
        _tile_stream_loadd(7, b + s * 16 * 64 + 16, 256);
        PRODUCTS
    }
    STORE(0, c); STORE(1, c); STORE(2, c); STORE(3, c);
}

__attribute__((noinline)) static void run(int v, long blocks, int steps) {
    if (v == PIPELINED) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        LOAD_STEP(0) PRODUCTS
    }
    if (v == ONEDNN) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (long b = 0; b < blocks; b++) {
            float *c = C[b & 7], *cp = C[(b + 7) & 7];
            for (int s = 0; s < steps; s++) {
                int first = s == 0 && b > 0, last = s == steps - 1;
                ONEDNN_STEP(s, last, first)
            }
        }
        return;
    }
    if (v >= VECTORS) {
        const __m512 m = _mm512_set1_ps(0.999f), a = _mm512_set1_ps(1e-3f);
        __m512 a0 = m, a1 = a, a2 = m, a3 = a, a4 = m, a5 = a, a6 = m, a7 = a;
        for (long b = 0; b < blocks; b++) {
            float *c = C[b & 7];
            int tiles = v == WITH_VECTORS || v == WITH_P0;
            if (tiles) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
            for (int s = 0; s < steps; s++) {
                if (tiles) { LOAD_STEP(s) PRODUCTS }
                if (v == VECTORS || v == WITH_VECTORS) { VECTOR_WORK(m, a) } else { P0_WORK(a) }
            }
            if (tiles) { STORE(0, c); STORE(1, c); STORE(2, c); STORE(3, c); }
        }
        __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                 _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
        SINK = _mm512_reduce_add_ps(t);
        return;
    }
    if (v == B_L2 || v == AB_L2) {
        for (long b = 0; b < blocks; b++) {
            long half = b & 1, panel = (b >> 1) % PANELS;
            const uint16_t *a = v == AB_L2 ? BIG_A[(b >> 1) % PANELS] : A;
            streamed_half(a, BIG_B[panel] + 32 * half, C[b & 7], steps);
        }
        return;
    }
    for (long b = 0; b < blocks; b++) {
        float *c = C[b & 7];
        if (v == ZERO || v == KERNEL) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
        for (int s = (v == PIPELINED); s < steps; s++) {
            if (v != NO_LOADS) { LOAD_STEP(s) }
            PRODUCTS
        }
        if (v == ONE_STORE) STORE(3, c);
        if (v == FOUR_STORES || v == KERNEL) { STORE(0, c); STORE(1, c); STORE(2, c); STORE(3, c); }
        if (v == PIPELINED) {
            _tile_loadd(4, A, 2 * LDA);
            _tile_loadd(6, B, 256);
            STORE(0, c); _tile_zero(0); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, B + 16, 256);
            STORE(1, c); _tile_zero(1); _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, A + 16 * LDA, 2 * LDA);
            STORE(2, c); _tile_zero(2); _tile_dpbf16ps(2, 5, 6);
            STORE(3, c); _tile_zero(3); _tile_dpbf16ps(3, 5, 7);
        }
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        puts("{\"amx\": null}");
        return 0;
    }
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
    for (size_t i = 0; i < sizeof A / sizeof A[0]; i++) A[i] = 0x3f80;         // 1.0
    for (size_t i = 0; i < sizeof B / sizeof B[0]; i++) B[i] = 0x00003f80u;     // (1.0, 0.0)
    for (int p = 0; p < PANELS; p++) {
        for (size_t i = 0; i < sizeof BIG_B[0] / sizeof BIG_B[0][0]; i++) BIG_B[p][i] = 0x00003f80u;
        for (size_t i = 0; i < sizeof BIG_A[0] / sizeof BIG_A[0][0]; i++) BIG_A[p][i] = 0x3f80;
    }
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    LOAD_STEP(0)
    const int depths[] = {4, 8, 16};
    printf("%-12s", "steps");
    for (int d = 0; d < 3; d++) printf("%8d", depths[d]);
    printf("   (GFLOP/s, one core, best of 5)\n");
    for (int v = 0; v < VARIANTS; v++) {
        printf("%-12s", NAMES[v]);
        for (int d = 0; d < 3; d++) {
            int steps = depths[d];
            long blocks = 1000000 / steps;
            double best = 1e30;
            for (int r = 0; r < 5; r++) {
                double t = now();
                run(v, blocks, steps);
                t = now() - t;
                if (t < best) best = t;
            }
            printf("%8.0f", (double)blocks * steps * 4 * 16 * 16 * 32 * 2 / best / 1e9);
        }
        printf("\n");
    }
    _tile_release();
    return 0;
}
