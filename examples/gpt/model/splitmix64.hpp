// SPDX-License-Identifier: Apache-2.0
// splitmix64: the counter-based mixer behind the example's random numbers (initialisation by
// (seed, tensor index), batch positions by (seed, step, micro-batch, sequence)), so every value
// depends on its key alone and comes out the same on every rank, in any order.
#pragma once

#include <cstdint>

namespace gpt::detail {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace gpt::detail
