// LD_PRELOAD diagnostic for benchmarks/exit_aborts.py --trace: on std::terminate, print the calling thread (id,
// name, whether it is the main thread) and its stack, then abort as the default handler does.
#include <execinfo.h>
#include <pthread.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {
void traced_terminate() {
  char name[32] = {0};
  pthread_getname_np(pthread_self(), name, sizeof name);
  std::fprintf(stderr, "terminate called (traced)\n");
  std::fprintf(stderr, "TERMINATE_TRACE pid %d tid %d thread '%s' main %d\n", getpid(), gettid(), name,
               getpid() == gettid());
  void* frames[64];
  int count = backtrace(frames, 64);
  backtrace_symbols_fd(frames, count, 2);
  std::abort();
}
__attribute__((constructor)) void install() { std::set_terminate(traced_terminate); }
}  // namespace
