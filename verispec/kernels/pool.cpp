// The kernels' thread pool (see pool.h): persistent workers, started once for a thread count, that wait for the next
// call by spinning a short while and then sleeping on a futex, so that the calls of a forward (microseconds apart)
// find them awake and a pause between forwards leaves the cores to others.
//
// A call is a job: its task and chunk size in `job`, published by one atomic word, `state` = (job number << 32) |
// (chunks claimed << 16) | chunks. A thread claims chunk i by moving state from (n, i, c) to (n, i + 1, c); a claim
// that succeeds proves job n still unfinished, so the task it read beside is job n's. The caller claims chunks too,
// and then waits for `done`, the chunks finished: never for a worker that has not started, so a worker whose core is
// busy elsewhere costs the call nothing unless it holds a chunk.
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "pool.h"

namespace {
const long MAX_THREADS = 1024;
const long CHUNKS_PER_THREAD = 4;  // more chunks than threads: a slow thread's share is taken by the others
const long MAX_CHUNKS = 0xffff;    // (16 bits of `state`)
using Clock = std::chrono::steady_clock;
const auto SPIN = std::chrono::microseconds(200);  // a worker's wait for the next call before it sleeps
const auto PATIENCE = std::chrono::microseconds(50);  // the caller's spin for the last chunks before it yields

struct Job {
  std::atomic<Task> task{nullptr};
  std::atomic<void*> context{nullptr};
  std::atomic<long> items{0}, chunk{1};
};

Job job;
std::atomic<uint64_t> state{0};
std::atomic<uint32_t> posted{0};  // the newest job's number: what a sleeping worker waits on
std::atomic<long> done{0};        // chunks of the current job finished
std::atomic<int> sleepers{0};
std::atomic<bool> busy{false};  // a caller is using the pool
std::atomic<long> threads{1};
std::atomic<uint32_t> epoch{0};  // workers started under an older epoch leave
long started = 0;                 // workers started under this epoch (changed only by the caller holding `busy`)
uint32_t jobs = 0;                // (likewise)

void futex_wait(std::atomic<uint32_t>* word, uint32_t value) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Claim and run chunks of job `number` until none is left to claim.
void work(uint32_t number) {
  for (;;) {
    uint64_t s = state.load(std::memory_order_acquire);
    const long claimed = (long)((s >> 16) & 0xffff), chunks = (long)(s & 0xffff);
    if ((uint32_t)(s >> 32) != number || claimed >= chunks) return;
    const Task task = job.task.load(std::memory_order_relaxed);
    void* const context = job.context.load(std::memory_order_relaxed);
    const long items = job.items.load(std::memory_order_relaxed), chunk = job.chunk.load(std::memory_order_relaxed);
    if (!state.compare_exchange_weak(s, s + (1u << 16), std::memory_order_acq_rel)) continue;
    const long begin = claimed * chunk, end = begin + chunk < items ? begin + chunk : items;
    task(context, begin, end);
    done.fetch_add(1, std::memory_order_release);
  }
}

void worker(uint32_t mine) {
  uint32_t seen = posted.load(std::memory_order_acquire);
  for (;;) {
    auto since = Clock::now();
    for (long spins = 1; posted.load(std::memory_order_acquire) == seen; spins++) {
      if (epoch.load(std::memory_order_relaxed) != mine) return;
      _mm_pause();
      if (spins % 256 == 0 && Clock::now() - since > SPIN) {
        sleepers.fetch_add(1);  // (sequentially consistent with the caller's publish and its look at sleepers)
        if (posted.load() == seen && epoch.load() == mine) futex_wait(&posted, seen);
        sleepers.fetch_sub(1);
        since = Clock::now();
      }
    }
    seen = posted.load(std::memory_order_acquire);
    if (epoch.load(std::memory_order_relaxed) != mine) return;
    work(seen);
  }
}

void start_workers(long count) {  // by the caller holding `busy`
  try {
    for (; started < count; started++) std::thread(worker, epoch.load()).detach();
  } catch (const std::exception&) {  // no more threads to be had: the caller and those started do the work
    started = count;
  }
}

void forget_workers_after_fork() {  // a forked child has none of the parent's threads
  started = 0;
  epoch.fetch_add(1);
  sleepers.store(0);
  busy.store(false);
}

struct AtFork {
  AtFork() { pthread_atfork(nullptr, nullptr, forget_workers_after_fork); }
} at_fork;
}  // namespace

void pool_run(long items, long grain, Task task, void* context) {
  if (items <= 0) return;
  const long n = threads.load(std::memory_order_relaxed);
  long chunks = (items + grain - 1) / (grain > 0 ? grain : 1);
  if (chunks > n * CHUNKS_PER_THREAD) chunks = n * CHUNKS_PER_THREAD;
  if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
  if (n <= 1 || chunks <= 1 || busy.exchange(true, std::memory_order_acquire)) {
    task(context, 0, items);  // alone: the same items, so the same bits
    return;
  }
  start_workers(n - 1);
  const long chunk = (items + chunks - 1) / chunks;
  chunks = (items + chunk - 1) / chunk;
  job.task.store(task, std::memory_order_relaxed);
  job.context.store(context, std::memory_order_relaxed);
  job.items.store(items, std::memory_order_relaxed);
  job.chunk.store(chunk, std::memory_order_relaxed);
  done.store(0, std::memory_order_relaxed);
  const uint32_t number = ++jobs;
  state.store((uint64_t)number << 32 | (uint64_t)chunks);
  posted.store(number);
  if (sleepers.load() > 0) futex_wake_all(&posted);
  work(number);
  const auto since = Clock::now();
  for (long spins = 1; done.load(std::memory_order_acquire) < chunks; spins++) {
    _mm_pause();  // a worker is finishing a chunk; past PATIENCE, let whatever shares this core run
    if (spins % 64 == 0 && Clock::now() - since > PATIENCE) sched_yield();
  }
  busy.store(false, std::memory_order_release);
}

// The pool's thread count, the caller included (1: every call runs on the caller alone). -1 for a count out of range.
extern "C" int vs_set_threads(long n) {
  if (n < 1 || n > MAX_THREADS) return -1;
  while (busy.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  if (n != threads.load()) {  // the old workers leave; the next call starts n - 1 new ones
    epoch.fetch_add(1);
    futex_wake_all(&posted);
    started = 0;
    threads.store(n);
  }
  busy.store(false, std::memory_order_release);
  return 0;
}

long pool_threads() { return threads.load(std::memory_order_relaxed); }
extern "C" long vs_threads() { return pool_threads(); }
extern "C" long vs_max_threads() { return MAX_THREADS; }
