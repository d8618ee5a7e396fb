// The weights a matvec reads next, asked for ahead of the arithmetic. A thread's output rows
// are one sequential stream, but the hardware prefetcher alone kept too few reads in flight
// while the kernels computed: a tied 262k-row Q8_0 LM head (178 MB, read once a token) took
// 10 ms cold where a plain read of as many bytes takes 6, the arithmetic and the memory's
// latency taking turns instead of overlapping.
#pragma once

#include <cstdint>

namespace pagedserve {

constexpr int64_t kPrefetchAhead = 2048;  // bytes ahead of the row being read

// The `bytes` that follow kPrefetchAhead bytes after `row`: called once per output row with
// the row's size, so that every line of the stream is asked for once, that far ahead.
inline void prefetch_ahead(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row) + kPrefetchAhead;
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

}  // namespace pagedserve
