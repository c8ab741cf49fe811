// Worker threads for the native kernels: a kernel splits its work into tasks and runs them on
// up to `threads` threads, the calling one (MLX's CPU stream) among them.
//
// MLX runs each CPU op on its stream's one thread, while a decode step of a few rows has work
// for every core (BLAS already takes them all for its products). Tasks write disjoint outputs
// with the arithmetic of a one-thread run, so results do not depend on the thread count.

#pragma once

#include <functional>

namespace salabatch {

// fn(i) for every i in [0, tasks), on at most `threads` threads (1: the caller alone, no
// hand-off). One call runs at a time; an exception in a task is rethrown to the caller.
void run_tasks(int tasks, int threads, const std::function<void(int)>& fn);

}  // namespace salabatch
