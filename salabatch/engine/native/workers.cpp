// A pool of helper threads, made on first use, grown to the most threads asked for, and never
// torn down (they sleep between calls; a process's exit does not wait for them). A forked child
// starts a pool of its own: its parent's threads do not exist there.

#include "workers.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

namespace salabatch {
namespace {

// Polls (yielding the core) before sleeping: a helper for the next call, the caller for the
// helpers' end. A decode step runs these kernels tens of microseconds apart, and waking a
// sleeping thread costs about as much as a small call.
constexpr int kSpin = 2000;

class Pool {
 public:
  void run(int tasks, int threads, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> one_call(call_);
    int helpers = std::min(threads, tasks) - 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(count_) < helpers) {
        std::thread([this] { help(); }).detach();
        ++count_;
      }
      fn_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      seats_ = helpers;
      error_ = nullptr;
      generation_.fetch_add(1);
    }
    if (helpers > 0) {
      wake_.notify_all();
    }
    share();
    for (int i = 0; i < kSpin && busy_.load() != 0; ++i) {
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_.load() == 0; });
    seats_ = 0;  // a helper that wakes from here on finds no seat and never sees fn
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  // Takes tasks until none is left.
  void share() {
    for (int i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
    }
  }

  void help() {
    uint64_t seen = generation_.load();
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      lock.unlock();
      for (int i = 0; i < kSpin && generation_.load() == seen; ++i) {
        std::this_thread::yield();
      }
      lock.lock();
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      if (seats_ == 0) {
        continue;
      }
      --seats_;
      busy_.fetch_add(1);
      lock.unlock();
      share();
      if (busy_.fetch_sub(1) == 1) {
        lock.lock();  // the caller checks busy_ under the lock: it is waiting or will see 0
        done_.notify_one();
      } else {
        lock.lock();
      }
    }
  }

  std::mutex call_;  // one call at a time
  std::mutex mu_;    // guards what follows, except the atomics
  std::condition_variable wake_, done_;
  size_t count_ = 0;  // helper threads started
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0, seats_ = 0;
  std::atomic<int> next_{0}, busy_{0};  // next task; helpers in share()
  std::atomic<uint64_t> generation_{0};
  std::exception_ptr error_;
};

Pool& pool() {
  static std::mutex mu;
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (pool == nullptr || owner != getpid()) {
    pool = new Pool();  // never deleted: see above
    owner = getpid();
  }
  return *pool;
}

}  // namespace

void run_tasks(int tasks, int threads, const std::function<void(int)>& fn) {
  if (tasks <= 0) {
    return;
  }
  if (threads <= 1 || tasks == 1) {
    for (int i = 0; i < tasks; ++i) {
      fn(i);
    }
    return;
  }
  pool().run(tasks, threads, fn);
}

}  // namespace salabatch
