// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `counter_init`: counter-based ("flyweight") initialisation. The initial value of
 *         element i of a tensor is a pure function of (seed, tensor key, i), so a rank
 *         materialises only the elements of its own shard and every world size starts from the
 *         same full tensor.
 *
 *  With a sequential generator the shard of rank r at N ranks would depend on how many values
 *  the ranks before it drew; RTP would then need the full tensor on every rank first (the
 *  reference builds the whole model on every host and slices it). Here nothing is drawn in
 *  order: element i is hashed from its global index.
 *
 *  The hash is splitmix64 (Steele, Lea and Flood's mixer, the finaliser of SplittableRandom):
 *  a stream per (seed, key), and per counter one splitmix64 output, mixed once more with the key
 *  so that two tensors whose streams happen to overlap still differ. Not cryptographic; meant for
 *  initialisation and synthetic data.
 *
 *  Reproducibility: `bits` and `uniform01` are integer arithmetic and one exact scaling, the same
 *  on every platform; `uniform` adds one IEEE multiply-add in double and one rounding to `T`.
 *  `normal` (Box-Muller) calls `std::log`, `std::cos` and `std::sqrt` in double, so its bits are
 *  those of the C library in use (identical across ranks and runs on one machine; a different
 *  libm may differ in the last bit of the double, which rounding to float almost always hides).
 */
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>
#include <string_view>

namespace chunkstar::rtp {

namespace detail {
inline constexpr std::uint64_t golden_gamma = 0x9E3779B97F4A7C15ULL;  // 2^64 / phi, splitmix64's increment

/** @brief splitmix64's finaliser: a bijection of 64-bit words with full avalanche. */
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
}  // namespace detail

/** @brief A 64-bit key for a tensor name (FNV-1a), so tensors can be keyed by the names they are
 *  registered under. */
constexpr std::uint64_t tensor_key(std::string_view name) noexcept {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (const char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ULL;
  }
  return h;
}

/** @brief The initial values of one tensor, element by element, by global index.
 *
 *  An aggregate: `counter_init{.seed = 7, .key = tensor_key("w1")}`. Every member function is a
 *  pure function of (seed, key, index), so `fill_normal(shard, first, ...)` on a shard equals the
 *  matching slice of `fill_normal(full, 0, ...)` bit for bit.
 */
struct counter_init {
  std::uint64_t seed = 0;  ///< the run's seed
  std::uint64_t key = 0;   ///< the tensor's key (`tensor_key(name)`, or any distinct number)

  /** @brief 64 random bits for element @p index; @p lane selects independent draws for one
   *  element (Box-Muller needs two). */
  [[nodiscard]] constexpr std::uint64_t bits(std::uint64_t index, std::uint64_t lane = 0) const noexcept {
    const std::uint64_t stream =
        detail::mix64(detail::mix64(seed + detail::golden_gamma) ^ (key * 0xD1B54A32D192ED03ULL));
    const std::uint64_t counter = 2 * index + (lane & 1U) + 1;  // two lanes per element
    return detail::mix64(detail::mix64(stream + counter * detail::golden_gamma) ^ key);
  }

  /** @brief Uniform in [0, 1): the top 53 bits of `bits(index, lane)`, scaled exactly. */
  [[nodiscard]] constexpr double uniform01(std::uint64_t index, std::uint64_t lane = 0) const noexcept {
    return static_cast<double>(bits(index, lane) >> 11) * 0x1.0p-53;
  }

  /** @brief Uniform in [lo, hi] (rounding to `T` may reach hi). */
  template <std::floating_point T = float>
  [[nodiscard]] T uniform(std::uint64_t index, T lo, T hi) const noexcept {
    const double l = lo, h = hi;
    return static_cast<T>(l + (h - l) * uniform01(index));
  }

  /** @brief Normal with mean @p mean and standard deviation @p stddev (Box-Muller, the cosine
   *  branch only, so each element uses its own two draws and no neighbour's). */
  template <std::floating_point T = float>
  [[nodiscard]] T normal(std::uint64_t index, T mean, T stddev) const noexcept {
    const double u1 = static_cast<double>((bits(index, 0) >> 11) + 1) * 0x1.0p-53;  // (0, 1]: log is finite
    const double u2 = uniform01(index, 1);
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    return static_cast<T>(static_cast<double>(mean) + static_cast<double>(stddev) * z);
  }

  /** @brief `out[k] = uniform(first + k, lo, hi)`: a contiguous run of the tensor starting at
   *  global index @p first. */
  template <std::floating_point T>
  void fill_uniform(std::span<T> out, std::uint64_t first, T lo, T hi) const noexcept {
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = uniform<T>(first + k, lo, hi);
  }

  /** @brief `out[k] = normal(first + k, mean, stddev)`. */
  template <std::floating_point T>
  void fill_normal(std::span<T> out, std::uint64_t first, T mean, T stddev) const noexcept {
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = normal<T>(first + k, mean, stddev);
  }
};

}  // namespace chunkstar::rtp
