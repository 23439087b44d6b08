// Work that torch's threads claim one task at a time (the CPU kernels' products use it).
//
// A fixed range per thread leaves the others waiting at the end when another process
// takes a core from one of them (the serving plane shares the cores); claimed tasks go to
// whichever thread is running (benchmarks/NOTES.md 45-46).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// Runs work(task) for every task in [0, tasks), each once, on up to torch's thread count.
// make_worker() runs once per thread and returns its `work`, which may own scratch space.
template <typename MakeWorker>
void for_each_claimed(int64_t tasks, const MakeWorker& make_worker) {
  if (tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t teams = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, teams, 1, [&](int64_t, int64_t) {
    auto work = make_worker();
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) work(task);
  });
}

// Runs work(task) for every task in [0, tasks) as for_each_claimed does, but each thread
// starts on a contiguous range of its own and claims it front to back, then the others'.
template <typename Work>
void for_each_claimed_in_ranges(int64_t tasks, const Work& work) {
  if (tasks <= 0) return;
  constexpr int kMaxTeams = 64;
  const int64_t teams = std::min<int64_t>({tasks, at::get_num_threads(), kMaxTeams});
  std::atomic<int64_t> next[kMaxTeams];
  int64_t end[kMaxTeams];
  for (int64_t t = 0; t < teams; ++t) {
    next[t].store(tasks * t / teams, std::memory_order_relaxed);
    end[t] = tasks * (t + 1) / teams;
  }
  at::parallel_for(0, teams, 1, [&](int64_t first, int64_t) {
    for (int64_t i = 0; i < teams; ++i) {
      const int64_t range = (first + i) % teams;
      for (int64_t task; (task = next[range].fetch_add(1, std::memory_order_relaxed)) < end[range];)
        work(task);
    }
  });
}
