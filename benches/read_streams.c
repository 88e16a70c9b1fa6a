/* One core's read bandwidth from DRAM: one contiguous stream against G streams read in lockstep
 * (G panels P bytes apart, as a decode tile reads G plain weight panels side by side), with and
 * without a software prefetch D bytes ahead. Best of 7 passes over 1 GiB on huge pages.
 * Why the CPU kernels keep bf16 panels in groups (rust/src/cpu/linear.rs; RESULTS.md round 16).
 *
 *     gcc -O2 -march=native benches/read_streams.c -o /tmp/read_streams && /tmp/read_streams
 */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SZ (1024UL << 20)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* sums every 64-byte line: groups of G streams P bytes apart, each prefetched D bytes ahead */
static float run(const char *b, int G, size_t P, int D) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (size_t base = 0; base + G * P <= SZ; base += G * P)
    for (size_t o = 0; o < P; o += 64)
      for (int g = 0; g < G; g++) {
        const char *p = b + base + g * P + o;
        if (D) _mm_prefetch(p + D, _MM_HINT_T0);
        int a = (g + o / 64) & 3; /* four independent chains whatever G is */
        acc[a] = _mm512_add_ps(acc[a], _mm512_loadu_ps((const float *)p));
      }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                            _mm512_add_ps(acc[2], acc[3])));
}

int main(void) {
  char *p = mmap(0, SZ + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char *b = (char *)(((size_t)p + (2 << 20) - 1) & ~((size_t)(2 << 20) - 1));
  madvise(b, SZ, MADV_HUGEPAGE);
  memset(b, 1, SZ);
  struct { int G; size_t P; int D; } v[] = {
      {1, SZ, 0}, {1, SZ, 2048}, {1, SZ, 8192}, {2, 32768, 2048}, {4, 32768, 0},
      {4, 32768, 2048}, {4, 32768, 8192}, {4, 1 << 20, 8192}};
  int n = sizeof v / sizeof v[0];
  double best[16] = {0};
  float sink = 0;
  for (int r = 0; r < 7; r++)
    for (int i = 0; i < n; i++) {
      double t = now();
      sink += run(b, v[i].G, v[i].P, v[i].D);
      double gbs = SZ / (now() - t) / 1e9;
      if (gbs > best[i]) best[i] = gbs;
    }
  for (int i = 0; i < n; i++)
    printf("%d stream(s) %7zu bytes apart, prefetch %5d bytes ahead: %.1f GB/s\n", v[i].G,
           v[i].G == 1 ? (size_t)0 : v[i].P, v[i].D, best[i]);
  return sink == 1234.5f;
}
