// A captured forward, replayed: the kernel calls that one forward made, in order, each with its argument array,
// run again without Python (models/captured.py records them). The arguments are the same pointers each time, so
// the tensors they point to (inputs copied in before, intermediate buffers, the cache) are the ones the calls read.
#include <time.h>

#include "simd.h"

#ifdef VS_KERNELS
extern "C" int vs_available() { return 1; }
#else
extern "C" int vs_available() { return 0; }
#endif

typedef int (*Kernel)(const int64_t*);

// program: for each call, the kernel's address, its argument count n, then its n arguments. Stops at the first call
// that fails and returns its index + 1 (0 when all ran).
extern "C" long vs_replay(const int64_t* program, long calls) {
  for (long i = 0; i < calls; i++) {
    const Kernel kernel = (Kernel)program[0];
    if (kernel(program + 2)) return i + 1;
    program += 2 + program[1];
  }
  return 0;
}

// The same, adding each call's wall time to seconds[i] (for profiling: `Program.timed`).
extern "C" long vs_replay_timed(const int64_t* program, long calls, double* seconds) {
  for (long i = 0; i < calls; i++) {
    timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    const int failed = ((Kernel)program[0])(program + 2);
    clock_gettime(CLOCK_MONOTONIC, &end);
    seconds[i] += (double)(end.tv_sec - start.tv_sec) + 1e-9 * (double)(end.tv_nsec - start.tv_nsec);
    if (failed) return i + 1;
    program += 2 + program[1];
  }
  return 0;
}

// A program inside a program (a greedy chain: a captured forward's program, then the step to the next token, then
// the next forward's): a[0] the program's code, a[1] its call count.
extern "C" int vs_run(const int64_t* a) { return vs_replay((const int64_t*)a[0], a[1]) ? -1 : 0; }
