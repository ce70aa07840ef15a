// The kernels' thread pool (pool.cpp): a call's work as items (a matmul's column blocks, attention's rows and key
// heads, a row-wise op's rows), cut into chunks that the calling thread and the pool's workers claim in turn.
//
// Exactness: an item is computed by the same instructions in the same order whichever thread claims it, and no item
// is a part of a reduction (work is split over output columns, heads or rows, never over a sum), so a call's result
// is bitwise the same at any thread count and any split. Chunks are claimed, not assigned: a worker that is late (its
// core busy with another process) claims none, and the caller does its share; a call waits only for chunks already
// being run.
#pragma once
#include <type_traits>

typedef void (*Task)(void* context, long begin, long end);  // items begin .. end - 1

// Run task over items 0 .. items - 1, in chunks of at least `grain` items, on the pool and the calling thread; returns
// when every item is done. One caller at a time uses the pool: a second, concurrent one runs its items itself.
void pool_run(long items, long grain, Task task, void* context);
long pool_threads();  // the pool's thread count, the caller's included

template <typename F>
static inline void parallel(long items, long grain, F&& f) {  // f(begin, end) over chunks of items
  pool_run(items, grain, [](void* c, long begin, long end) { (*(std::remove_reference_t<F>*)c)(begin, end); }, &f);
}
