// Software prefetches for a kernel that runs a weight in passes over several calls (the packed
// float32 tile, packed_linear.cpp): each pass takes a few panels of W and runs every block of
// x's rows over them, block after block, so a panel comes from DRAM in the pass's first call and
// from L2 in the others.
//
// Left to the hardware, a product then waited on DRAM in each first call and left DRAM idle in
// all the calls after it: the time was the sum of the memory's and the arithmetic's. Two kinds of
// prefetch make them overlap (PassPrefetch): the first call streams its panels, asking for each
// line 4 KB ahead of its load (the hardware prefetcher stops at every 4 KB page), and when a
// pass has several calls, each asks, spread evenly over its steps of k, for its share of the
// next pass's panels, so these arrive while the arithmetic on the current ones runs.
//
// The next panels go to L2 only: asked into L1, they evicted the panels and x in use, and
// SmolLM2's float32 products at 64 rows ran slower. Near the end of W the streaming addresses
// run past it, which is harmless: a prefetch never faults.
//
// The AMX kernel (bfloat16_linear.cpp) has the same passes but gained nothing from either kind
// (both made SmolLM2's bfloat16 products at 64 rows a little slower): what holds it at 64 rows
// is not the DRAM stream.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

class PassPrefetch {
 public:
  static constexpr int64_t kLineBytes = 64;
  static constexpr int64_t kStreamAheadBytes = 4096;

  PassPrefetch() = default;
  // `stream`: this call is the pass's first. `next`, `lines`: its share of the next pass's
  // panels, asked for over `steps` steps of k.
  PassPrefetch(bool stream, const void* next, int64_t lines, int64_t steps)
      : stream_(stream), next_(static_cast<const char*>(next)), lines_(lines), steps_(steps) {}

  // At the step of k that loads `bytes` of a panel from `row`.
  [[gnu::always_inline]] void own(const void* row, int64_t bytes) const {
    if (!stream_) return;
    const char* ahead = static_cast<const char*>(row) + kStreamAheadBytes;
    for (int64_t i = 0; i < bytes; i += kLineBytes) _mm_prefetch(ahead + i, _MM_HINT_T0);
  }

  // Once per step of k: `lines` lines over `steps` steps, as evenly as whole lines allow.
  [[gnu::always_inline]] void next_step() {
    for (due_ += lines_; due_ >= steps_; due_ -= steps_, next_ += kLineBytes)
      _mm_prefetch(next_, _MM_HINT_T1);
  }

  // The share of call `call` of `calls` in a pass whose next panels are `next_lines` lines from
  // `next`, for a call of `steps` steps of k.
  static PassPrefetch share(int64_t call, int64_t calls, const void* next, int64_t next_lines,
                            int64_t steps) {
    const int64_t begin = call * next_lines / calls, end = (call + 1) * next_lines / calls;
    return {call == 0, static_cast<const char*>(next) + begin * kLineBytes, end - begin, steps};
  }

 private:
  bool stream_ = false;
  const char* next_ = nullptr;
  int64_t lines_ = 0, steps_ = 1, due_ = 0;
};

}  // namespace tokenmill
