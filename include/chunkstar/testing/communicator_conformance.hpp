// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `check_communicator`: the requirements of the `Communicator` concept
 *         (chunkstar/comm/communicator.hpp), checked on any model, one rank at a time.
 *
 *  Every rank of the group calls `check_communicator(comm)` with its own communicator, at the same
 *  time (threads for `in_process_group`, processes for MPI); each gets the report of what it saw,
 *  and the caller combines them (`combine_rank_reports`, or an allreduce of `ok()`). The checks issue
 *  the same collectives on every rank whatever they find, so a failed law on one rank never leaves
 *  the others waiting. An exception the model throws where none is expected (a transport failure)
 *  is not caught: the other ranks cannot go on with the sequence, so the caller decides (an
 *  in-process group fails every peer; an MPI program should abort the job).
 *
 *  Checked, for each of f32, f16, bf16 and sum, max, min, sync and async, counts from 0 to 1001:
 *  - (1) `rank()` in [0, size()), `size()` >= 1, each rank's `rank()` distinct (gathered), (9)
 *    barriers;
 *  - (2, 3, 5, 6) allreduce (both overloads), reduce_scatter (also in place) and the rooted reduce
 *    (to every root, also in place) give, bit for bit, the rank-order reduction 0..N-1 in float
 *    (double), rounded once — or, with `exact = false` (NCCL), that reduction to a reduction-order
 *    tolerance; in-place reduce_scatter leaves the other blocks alone; a reduce writes nothing on
 *    the ranks other than the root (their recv keeps a sentinel, or is null) and no rank's send;
 *    results are bit-identical on every rank and on a repeat;
 *  - a reduce's comm_stats volumes, on models with `stats()`: (N-1)·b into the root, b out of every
 *    other rank, one collective;
 *  - (4) allgather (also in place), (7) broadcast from every root, (8) ring_shift one step and
 *    size() steps (home again), send buffer untouched;
 *  - (10) eight async collectives outstanding at once (two of them reduces to different roots),
 *    waited for in reverse order; default and moved-from handles are complete;
 *  - argument errors throw `config_error` at the call, identically on every model: a bad root, an
 *    overlapping allgather or ring_shift, a reduce's send and recv overlapping on the root, a null
 *    buffer with a non-zero count.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/testing/conformance.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace chunkstar::testing {

/** @brief Memory the checks hand to a communicator's collectives: `Buffer(bytes)`, `data()`,
 *  `write(src, bytes, offset)` and `read()` → all bytes. Host memory for most models
 *  (`host_buffer`); device memory for NCCL (write by cudaMemcpy, read after a device sync). */
template <class B>
concept communicator_buffer = std::constructible_from<B, std::size_t> &&
    requires(B& b, const B& cb, const void* src, std::size_t n) {
  { b.data() } -> std::same_as<void*>;
  b.write(src, n, n);
  { cb.read() } -> std::same_as<std::vector<std::byte>>;
};

/** @brief Host memory as a `communicator_buffer`. */
class host_buffer {
 public:
  explicit host_buffer(std::size_t bytes) : bytes_(bytes) {}
  void* data() noexcept { return bytes_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  void write(const void* src, std::size_t n, std::size_t offset = 0) {
    if (n != 0) std::memcpy(bytes_.data() + offset, src, n);
  }
  [[nodiscard]] std::vector<std::byte> read() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

static_assert(communicator_buffer<host_buffer>);

/** @brief The groups of checks, to run some only (`communicator_conformance_options::only`). */
enum class communicator_check : std::uint8_t {
  rank_size,       ///< rank(), size(), barrier(), argument errors
  allreduce,       ///< allreduce(p, n, t, op) and allreduce_async against the rank-order reference
  allreduce_f64,   ///< allreduce(span<double>, op), sync and async
  reduce_scatter,  ///< reduce_scatter, out of place and in place, sync and async
  reduce,          ///< the rooted reduce to every root, out of place and in place, sync and async; stats
  allgather,       ///< allgather, out of place and in place, sync and async
  broadcast,       ///< broadcast from every root, sync and async; bad roots
  ring_shift,      ///< ring_shift one step and size() steps, sync and async; overlaps refused
  async,           ///< several async collectives outstanding; handle semantics
  determinism,     ///< bit-identical results across ranks and repeats
};

/** @brief What `check_communicator` runs, and how it compares reductions. */
struct communicator_conformance_options {
  /** Reductions are the bit-exact rank-order fold of the concept (false: the model reduces in its
   *  own order, as NCCL does; results are checked to a reduction-order tolerance instead). */
  bool exact = true;
  std::vector<communicator_check> only{};  ///< the groups to run; empty: all of them
};

namespace comm_detail {

/** @brief splitmix64's finaliser. */
inline std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace comm_detail

/** @brief The value rank @p rank contributes at index @p i for @p seed: a full mantissa and
 *  exponents 2^-4..2^4, so sums round and the reduction order shows. Every rank can compute every
 *  rank's input, which is how results are checked without communication. */
inline float communicator_test_value(std::uint64_t seed, int rank, std::size_t i) {
  using comm_detail::mix;
  const std::uint64_t h = mix(mix(seed) ^ mix(static_cast<std::uint64_t>(rank) + 1000) ^ (i * 0x2545f4914f6cdd1dull));
  const float mantissa = 0.5f + static_cast<float>(h & 0xffffffu) / 16777216.0f;
  const int exponent = static_cast<int>((h >> 24) % 9) - 4;
  const float v = std::ldexp(mantissa, exponent);
  return ((h >> 40) & 1u) ? -v : v;
}

namespace comm_detail {

template <class T>
std::vector<T> rank_data(std::uint64_t seed, int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = from_float<T>(communicator_test_value(seed, rank, i));
  return v;
}

inline std::vector<std::byte> rank_bytes(std::uint64_t seed, int rank, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::byte>(mix(seed * 31 + static_cast<std::uint64_t>(rank) * 7919 + i) & 0xff);
  return v;
}

/** @brief The specified reduction step, written independently of the library's. */
template <class F>
F combine_ref(F acc, F x, reduce_op op) {
  if (op == reduce_op::sum) return acc + x;
  if (op == reduce_op::max) return std::isnan(acc) ? acc : std::isnan(x) ? x : (acc < x ? x : acc);
  return std::isnan(acc) ? acc : std::isnan(x) ? x : (x < acc ? x : acc);
}

/** @brief The reduction over @p nranks ranks of `rank_data<T>(seed, k, n)`: rank order 0..N-1 in
 *  float, rounded once; @p reverse folds the other way (to show that the order is observable). */
template <class T>
std::vector<T> reference(std::uint64_t seed, int nranks, std::size_t n, reduce_op op, bool reverse = false) {
  std::vector<std::vector<T>> all;
  for (int k = 0; k < nranks; ++k) all.push_back(rank_data<T>(seed, k, n));
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (nranks == 1) {
      out[i] = all[0][i];
      continue;
    }
    float acc = to_float(all[static_cast<std::size_t>(reverse ? nranks - 1 : 0)][i]);
    for (int j = 1; j < nranks; ++j)
      acc = combine_ref(acc, to_float(all[static_cast<std::size_t>(reverse ? nranks - 1 - j : j)][i]), op);
    out[i] = from_float<T>(acc);
  }
  return out;
}

/** @brief Sum of |x| over ranks in double: the scale of the tolerance when not exact. */
template <class T>
std::vector<double> abs_sum(std::uint64_t seed, int nranks, std::size_t n) {
  std::vector<double> s(n, 0.0);
  for (int k = 0; k < nranks; ++k) {
    const auto d = rank_data<T>(seed, k, n);
    for (std::size_t i = 0; i < n; ++i) s[i] += std::fabs(static_cast<double>(to_float(d[i])));
  }
  return s;
}

template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, float>) return 0x1p-24;
  else if constexpr (std::is_same_v<T, float16>) return 0x1p-11;
  else return 0x1p-8;
}

/** @brief Index of the first element where @p got_bytes differs from @p want (bitwise when exact,
 *  otherwise beyond a reduction-order bound), or n when none does. */
template <class T>
std::size_t first_bad(const std::vector<std::byte>& got_bytes, const std::vector<T>& want, bool exact,
                      const std::vector<double>& scale, int nranks) {
  const std::size_t n = want.size();
  if (got_bytes.size() < n * sizeof(T)) return 0;
  std::vector<T> got(n);
  if (n != 0) std::memcpy(got.data(), got_bytes.data(), n * sizeof(T));
  for (std::size_t i = 0; i < n; ++i) {
    if (exact) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) return i;
    } else {
      const double tol = 2.0 * (nranks + 1) * unit_roundoff<T>() * scale[i];
      if (std::fabs(static_cast<double>(to_float(got[i])) - static_cast<double>(to_float(want[i]))) > tol) return i;
    }
  }
  return n;
}

inline std::string describe(const char* what, dtype t, reduce_op op, std::size_t count, int rank, int size) {
  return std::string(what) + " " + std::string(dtype_name(t)) + " " + std::string(reduce_op_name(op)) +
         " count=" + std::to_string(count) + " on rank " + std::to_string(rank) + " of " + std::to_string(size);
}

template <class Fn>
void for_each_dtype(Fn&& fn) {
  fn(float{});
  fn(float16{});
  fn(bfloat16{});
}

inline constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::max, reduce_op::min};
inline constexpr std::size_t reduce_counts[] = {0, 1, 2, 7, 33, 1001};
inline constexpr std::size_t byte_counts[] = {0, 1, 13, 1000};

/** @brief Expects @p f to throw `config_error` (an argument error, thrown at the call). */
template <class F>
void expect_config_error(conformance_report& r, F&& f, const std::string& what) {
  try {
    f();
    r.fail(what + " did not throw config_error (argument errors are thrown at the call)");
  } catch (const config_error&) {
    r.expect(true, "");
  } catch (...) {
    r.fail(what + " threw something other than config_error: " + current_exception_message());
  }
}

template <class B, class T, class C>
void allreduce_one(conformance_report& r, C& comm, std::size_t count, reduce_op op, bool async, std::uint64_t seed,
                   bool exact) {
  const int n = comm.size();
  const auto mine = rank_data<T>(seed, comm.rank(), count);
  B buf(count * sizeof(T));
  buf.write(mine.data(), count * sizeof(T), 0);
  if (async) {
    comm_handle h = comm.allreduce_async(buf.data(), count, dtype_of_v<T>, op);
    h.wait();
    r.expect(h.ready(), "allreduce_async: the handle is not ready() after wait()");
  } else {
    comm.allreduce(buf.data(), count, dtype_of_v<T>, op);
  }
  const auto want = reference<T>(seed, n, count, op);
  const std::size_t bad = first_bad(buf.read(), want, exact, abs_sum<T>(seed, n, count), n);
  r.expect(bad == count, [&] {
    return describe(async ? "allreduce_async" : "allreduce", dtype_of_v<T>, op, count, comm.rank(), n) + ": element " +
           std::to_string(bad) + " differs from the rank-order reduction";
  });
}

template <class B, class C>
void allreduce_checks(conformance_report& r, C& comm, bool exact) {
  for (bool async : {false, true}) {
    std::uint64_t seed = 11;
    for_each_dtype([&](auto tag) {
      using T = decltype(tag);
      for (reduce_op op : all_ops)
        for (std::size_t count : reduce_counts) allreduce_one<B, T>(r, comm, count, op, async, ++seed, exact);
    });
  }
}

template <class C>
void allreduce_f64_checks(conformance_report& r, C& comm, bool exact) {
  const int n = comm.size();
  std::uint64_t seed = 101;
  for (reduce_op op : all_ops) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{64}}) {
      for (bool async : {false, true}) {
        ++seed;
        auto value = [&](int k, std::size_t i) {
          return static_cast<double>(communicator_test_value(seed, k, i)) * (1.0 + 0x1p-40 * double(i));
        };
        std::vector<double> v(count);
        for (std::size_t i = 0; i < count; ++i) v[i] = value(comm.rank(), i);
        if (async) {
          comm_handle h = comm.allreduce_async(std::span<double>(v), op);
          h.wait();
        } else {
          comm.allreduce(std::span<double>(v), op);
        }
        std::size_t bad = count;
        for (std::size_t i = 0; i < count && bad == count; ++i) {
          double acc = value(0, i);
          double scale = std::fabs(acc);
          for (int k = 1; k < n; ++k) {
            acc = combine_ref(acc, value(k, i), op);
            scale += std::fabs(value(k, i));
          }
          const bool ok = exact ? std::memcmp(&acc, &v[i], sizeof(double)) == 0
                                : std::fabs(acc - v[i]) <= 4.0 * n * 0x1p-53 * scale;
          if (!ok) bad = i;
        }
        r.expect(bad == count, [&] {
          return "allreduce(span<double>) " + std::string(reduce_op_name(op)) + " count=" + std::to_string(count) +
                 (async ? " async" : "") + " on rank " + std::to_string(comm.rank()) + ": element " +
                 std::to_string(bad) + " differs from the rank-order reduction in double";
        });
      }
    }
  }
}

template <class B, class C>
void reduce_scatter_checks(conformance_report& r, C& comm, bool exact) {
  const int n = comm.size();
  const int rk = comm.rank();
  const auto me = static_cast<std::size_t>(rk);
  for (bool async : {false, true}) {
    std::uint64_t seed = 1000;
    for_each_dtype([&](auto tag) {
      using T = decltype(tag);
      for (reduce_op op : all_ops) {
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{17}}) {
          for (bool in_place : {false, true}) {
            ++seed;
            const std::size_t total = count * static_cast<std::size_t>(n);
            const auto mine = rank_data<T>(seed, rk, total);
            B send(total * sizeof(T));
            send.write(mine.data(), total * sizeof(T), 0);
            B recv(count * sizeof(T));
            void* out = in_place ? static_cast<std::byte*>(send.data()) + me * count * sizeof(T) : recv.data();
            if (async) {
              comm_handle h = comm.reduce_scatter_async(send.data(), out, count, dtype_of_v<T>, op);
              h.wait();
            } else {
              comm.reduce_scatter(send.data(), out, count, dtype_of_v<T>, op);
            }
            std::vector<std::byte> got = in_place ? send.read() : recv.read();
            if (in_place) got.erase(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(me * count * sizeof(T)));
            got.resize(count * sizeof(T));
            const auto full = reference<T>(seed, n, total, op);
            const std::vector<T> want(full.begin() + static_cast<std::ptrdiff_t>(me * count),
                                      full.begin() + static_cast<std::ptrdiff_t>((me + 1) * count));
            const auto scale_full = abs_sum<T>(seed, n, total);
            const std::vector<double> scale(scale_full.begin() + static_cast<std::ptrdiff_t>(me * count),
                                            scale_full.begin() + static_cast<std::ptrdiff_t>((me + 1) * count));
            const std::size_t bad = first_bad(got, want, exact, scale, n);
            r.expect(bad == count, [&] {
              return describe("reduce_scatter", dtype_of_v<T>, op, count, rk, n) + (in_place ? " in place" : "") +
                     (async ? " async" : "") + ": element " + std::to_string(bad) +
                     " of this rank's block differs from the rank-order reduction";
            });
            if (in_place) {  // the other blocks of send are untouched
              const auto after = send.read();
              bool others_kept = true;
              for (int k = 0; k < n; ++k) {
                if (k == rk) continue;
                const std::size_t off = static_cast<std::size_t>(k) * count * sizeof(T);
                if (count != 0 && std::memcmp(after.data() + off, reinterpret_cast<const std::byte*>(mine.data()) + off,
                                              count * sizeof(T)) != 0)
                  others_kept = false;
              }
              r.expect(others_kept, [&] {
                return describe("reduce_scatter", dtype_of_v<T>, op, count, rk, n) +
                       " in place changed another rank's block of send";
              });
            }
          }
        }
      }
    });
  }
}

template <class B, class C>
void reduce_checks(conformance_report& r, C& comm, bool exact) {
  const int n = comm.size();
  const int rk = comm.rank();
  constexpr std::byte sentinel{0xa5};
  auto as_bytes = [](const auto& v) {
    std::vector<std::byte> b(v.size() * sizeof(v[0]));
    if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  for (bool async : {false, true}) {
    std::uint64_t seed = 3000;
    for_each_dtype([&](auto tag) {
      using T = decltype(tag);
      for (reduce_op op : all_ops) {
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{17}, std::size_t{1001}}) {
          for (int root = 0; root < n; ++root) {
            for (bool in_place : {false, true}) {
              ++seed;
              const std::size_t bytes = count * sizeof(T);
              const auto mine = as_bytes(rank_data<T>(seed, rk, count));
              const std::vector<std::byte> fill(bytes, sentinel);
              B send(bytes), recv(bytes);
              send.write(mine.data(), bytes, 0);
              recv.write(fill.data(), bytes, 0);
              void* out = in_place ? send.data() : recv.data();  // on every rank: in place at the root
              if (async) {
                comm_handle h = comm.reduce_async(send.data(), out, count, dtype_of_v<T>, op, root);
                h.wait();
              } else {
                comm.reduce(send.data(), out, count, dtype_of_v<T>, op, root);
              }
              const std::string what = describe(async ? "reduce_async" : "reduce", dtype_of_v<T>, op, count, rk, n) +
                                       " to root " + std::to_string(root) + (in_place ? " in place" : "");
              const auto send_after = send.read();
              const auto recv_after = recv.read();
              if (rk == root) {
                const auto want = reference<T>(seed, n, count, op);
                const std::size_t bad = first_bad(in_place ? send_after : recv_after, want, exact,
                                                  exact ? std::vector<double>{} : abs_sum<T>(seed, n, count), n);
                r.expect(bad == count, [&] {
                  return what + ": element " + std::to_string(bad) +
                         " at the root differs from the rank-order reduction";
                });
                if (!in_place) r.expect(send_after == mine, [&] { return what + ": the root's send was modified"; });
              } else {
                r.expect(send_after == mine,
                         [&] { return what + ": send was modified on a rank other than the root"; });
                r.expect(recv_after == fill, [&] { return what + ": recv was written on a rank other than the root"; });
              }
            }
          }
        }
      }
    });
  }
  // Ranks other than the root may pass a null recv, or one overlapping send: it is not looked at.
  for (bool async : {false, true}) {
    for (int root = 0; root < n; ++root) {
      for (bool null_elsewhere : {true, false}) {
        const std::uint64_t seed =
            3900 + static_cast<std::uint64_t>(root) * 4 + (async ? 2u : 0u) + (null_elsewhere ? 1u : 0u);
        const std::size_t count = 5;
        const auto mine = as_bytes(rank_data<float>(seed, rk, count));
        B send(count * sizeof(float)), recv(count * sizeof(float));
        send.write(mine.data(), mine.size(), 0);
        void* out = rk == root       ? recv.data()
                    : null_elsewhere ? nullptr
                                     : static_cast<std::byte*>(send.data()) + sizeof(float);
        const std::string what = std::string(async ? "reduce_async" : "reduce") + " to root " + std::to_string(root) +
                                 " on rank " + std::to_string(rk) +
                                 (null_elsewhere ? " (recv null" : " (recv overlapping send") + " on the other ranks)";
        // A config_error here is not caught: the other ranks are in the collective already.
        if (async) comm.reduce_async(send.data(), out, count, dtype::f32, reduce_op::sum, root).wait();
        else comm.reduce(send.data(), out, count, dtype::f32, reduce_op::sum, root);
        if (rk == root) {
          const std::size_t bad = first_bad(recv.read(), reference<float>(seed, n, count, reduce_op::sum), exact,
                                            abs_sum<float>(seed, n, count), n);
          r.expect(bad == count, [&] { return what + ": element " + std::to_string(bad) + " at the root is wrong"; });
        } else {
          r.expect(send.read() == mine, [&] { return what + ": send was modified"; });
        }
      }
    }
  }
  // Nothing to reduce: null buffers everywhere are fine.
  comm.reduce(nullptr, nullptr, 0, dtype::bf16, reduce_op::max, n - 1);
  // comm_stats volumes, where the model keeps them (not part of the concept).
  if constexpr (requires(const C& c) {
                  { c.stats() } -> std::convertible_to<comm_stats>;
                }) {
    const std::size_t count = 100, b = count * 2;
    B send(b), recv(b);
    send.write(as_bytes(rank_data<float16>(3999, rk, count)).data(), b, 0);
    for (int root = 0; root < n; ++root) {
      for (bool async : {false, true}) {
        const comm_stats before = comm.stats();
        if (async) comm.reduce_async(send.data(), recv.data(), count, dtype::f16, reduce_op::sum, root).wait();
        else comm.reduce(send.data(), recv.data(), count, dtype::f16, reduce_op::sum, root);
        const comm_stats after = comm.stats();
        const std::uint64_t sent = after.bytes_sent - before.bytes_sent;
        const std::uint64_t received = after.bytes_received - before.bytes_received;
        const std::uint64_t want_sent = n > 1 && rk != root ? b : 0;
        const std::uint64_t want_received = n > 1 && rk == root ? b * static_cast<std::uint64_t>(n - 1) : 0;
        r.expect(sent == want_sent && received == want_received, [&] {
          return std::string(async ? "reduce_async" : "reduce") + " of " + std::to_string(b) + " bytes to root " +
                 std::to_string(root) + " on rank " + std::to_string(rk) + " of " + std::to_string(n) +
                 ": comm_stats counts " + std::to_string(sent) + " sent, " + std::to_string(received) +
                 " received; expected " + std::to_string(want_sent) + " sent, " + std::to_string(want_received) +
                 " received ((N-1)*b into the root, b out of every other rank)";
        });
        // A model that counts collectives (single_process keeps no stats at all) counts this one once.
        if (after.collectives != 0)
          r.expect(after.collectives - before.collectives == 1, [&] {
            return "reduce on rank " + std::to_string(rk) + ": comm_stats counted " +
                   std::to_string(after.collectives - before.collectives) + " collectives, not 1";
          });
      }
    }
  }
  // Argument errors, at the call: a bad root on every rank; on a rank that is its own root (no
  // communication starts, so each rank names itself), overlapping send and recv and null buffers.
  B buf(64), other(64);
  auto* p = static_cast<std::byte*>(buf.data());
  expect_config_error(
      r, [&] { comm.reduce(p, other.data(), 4, dtype::f32, reduce_op::sum, n); }, "reduce with root = size()");
  expect_config_error(
      r, [&] { comm.reduce(p, other.data(), 4, dtype::f32, reduce_op::sum, -1); }, "reduce with root = -1");
  expect_config_error(
      r, [&] { (void)comm.reduce_async(p, other.data(), 4, dtype::f32, reduce_op::sum, n); },
      "reduce_async with root = size()");
  expect_config_error(
      r, [&] { comm.reduce(p, p + 4, 8, dtype::f32, reduce_op::sum, rk); },
      "reduce with send and recv overlapping on the root (not equal)");
  expect_config_error(
      r, [&] { (void)comm.reduce_async(p + 8, p, 8, dtype::f16, reduce_op::max, rk); },
      "reduce_async with send and recv overlapping on the root (not equal)");
  expect_config_error(
      r, [&] { comm.reduce(nullptr, other.data(), 4, dtype::f32, reduce_op::sum, rk); },
      "reduce of 4 elements from a null send");
  expect_config_error(
      r, [&] { comm.reduce(p, nullptr, 4, dtype::f32, reduce_op::sum, rk); },
      "reduce of 4 elements into a null recv on the root");
}

template <class B, class C>
void allgather_checks(conformance_report& r, C& comm) {
  const int n = comm.size();
  const int rk = comm.rank();
  const auto me = static_cast<std::size_t>(rk);
  for (bool async : {false, true}) {
    std::uint64_t seed = 5000;
    for (std::size_t bytes : byte_counts) {
      for (bool in_place : {false, true}) {
        ++seed;
        const auto mine = rank_bytes(seed, rk, bytes);
        B send(bytes);
        send.write(mine.data(), bytes, 0);
        B recv(bytes * static_cast<std::size_t>(n));
        if (in_place) recv.write(mine.data(), bytes, me * bytes);
        const void* src = in_place ? static_cast<const std::byte*>(recv.data()) + me * bytes : send.data();
        if (async) {
          comm_handle h = comm.allgather_async(src, recv.data(), bytes);
          h.wait();
        } else {
          comm.allgather(src, recv.data(), bytes);
        }
        std::vector<std::byte> want;
        for (int k = 0; k < n; ++k) {
          const auto part = rank_bytes(seed, k, bytes);
          want.insert(want.end(), part.begin(), part.end());
        }
        r.expect(recv.read() == want, [&] {
          return "allgather bytes=" + std::to_string(bytes) + (in_place ? " in place" : "") + (async ? " async" : "") +
                 " on rank " + std::to_string(rk) + ": recv does not hold rank k's bytes at k * bytes";
        });
      }
    }
  }
}

template <class B, class C>
void broadcast_checks(conformance_report& r, C& comm) {
  const int n = comm.size();
  const int rk = comm.rank();
  for (bool async : {false, true}) {
    std::uint64_t seed = 7000;
    for (int root = 0; root < n; ++root) {
      for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{4096}}) {
        ++seed;
        const auto mine = rank_bytes(seed, rk, bytes);
        B buf(bytes);
        buf.write(mine.data(), bytes, 0);
        if (async) {
          comm_handle h = comm.broadcast_async(buf.data(), bytes, root);
          h.wait();
        } else {
          comm.broadcast(buf.data(), bytes, root);
        }
        r.expect(buf.read() == rank_bytes(seed, root, bytes), [&] {
          return "broadcast bytes=" + std::to_string(bytes) + " root=" + std::to_string(root) +
                 (async ? " async" : "") + " on rank " + std::to_string(rk) +
                 ": the buffer does not hold the root's bytes";
        });
      }
    }
  }
  B buf(8);
  expect_config_error(
      r, [&] { comm.broadcast(buf.data(), 8, n); }, "broadcast with root = size()");
  expect_config_error(
      r, [&] { comm.broadcast(buf.data(), 8, -1); }, "broadcast with root = -1");
}

template <class B, class C>
void ring_shift_checks(conformance_report& r, C& comm) {
  const int n = comm.size();
  const int rk = comm.rank();
  const int prev = (rk - 1 + n) % n;
  for (bool async : {false, true}) {
    std::uint64_t seed = 9000;
    for (std::size_t bytes : byte_counts) {
      ++seed;
      // One step: receive the predecessor's bytes.
      B a(bytes), b(bytes);
      a.write(rank_bytes(seed, rk, bytes).data(), bytes, 0);
      if (async) {
        comm_handle h = comm.ring_shift_async(a.data(), b.data(), bytes);
        h.wait();
      } else {
        comm.ring_shift(a.data(), b.data(), bytes);
      }
      const std::string what = std::string(async ? "ring_shift_async" : "ring_shift") +
                               " bytes=" + std::to_string(bytes) + " on rank " + std::to_string(rk);
      r.expect(b.read() == rank_bytes(seed, prev, bytes),
               [&] { return what + ": recv does not hold the previous rank's bytes"; });
      r.expect(a.read() == rank_bytes(seed, rk, bytes), [&] { return what + ": send was modified"; });
      // size() steps, ping-ponging two buffers, bring every shard home; step k holds rank r-k's.
      B* cur = &a;
      B* nxt = &b;
      bool every_step_right = true;
      for (int step = 1; step <= n; ++step) {
        comm.ring_shift(cur->data(), nxt->data(), bytes);
        if (nxt->read() != rank_bytes(seed, ((rk - step) % n + n) % n, bytes)) every_step_right = false;
        std::swap(cur, nxt);
      }
      r.expect(every_step_right, [&] { return what + ": after k steps a rank does not hold rank (r - k)'s shard"; });
      r.expect(cur->read() == rank_bytes(seed, rk, bytes),
               [&] { return what + ": size() steps did not bring the shard home"; });
    }
  }
  // Overlapping send/recv is refused at the call, before any communication.
  B buf(64);
  auto* p = static_cast<std::byte*>(buf.data());
  expect_config_error(
      r, [&] { comm.ring_shift(p, p, 32); }, "ring_shift with send == recv");
  expect_config_error(
      r, [&] { comm.ring_shift(p, p + 16, 32); }, "ring_shift with overlapping send and recv");
  expect_config_error(
      r, [&] { (void)comm.ring_shift_async(p + 16, p, 32); }, "ring_shift_async with overlapping send and recv");
  comm.ring_shift(p, p + 32, 32);  // adjacent, not overlapping: fine
}

template <class B, class C>
void async_checks(conformance_report& r, C& comm, bool exact) {
  const int n = comm.size();
  const int rk = comm.rank();
  const auto nn = static_cast<std::size_t>(n);
  const std::size_t count = 129, bytes = 77;
  const std::uint64_t s1 = 301, s2 = 302, s3 = 303, s4 = 304, s5 = 305, s6 = 306, s7 = 307;
  B ar(count * sizeof(float));
  ar.write(rank_data<float>(s1, rk, count).data(), count * sizeof(float), 0);
  B ag_send(bytes), ag_recv(bytes * nn);
  ag_send.write(rank_bytes(s2, rk, bytes).data(), bytes, 0);
  B rs_send(count * nn * 2), rs_recv(count * 2);
  rs_send.write(rank_data<bfloat16>(s3, rk, count * nn).data(), count * nn * 2, 0);
  B bc(bytes);
  bc.write(rank_bytes(s4, rk, bytes).data(), bytes, 0);
  B rs_a(bytes), rs_b(bytes);
  rs_a.write(rank_bytes(s5, rk, bytes).data(), bytes, 0);
  std::vector<double> scalars{double(rk), 1.0, -double(rk)};
  // Two rooted reduces, to different roots: f16 min out of place to root 0, f32 sum in place to root n-1.
  const std::vector<std::byte> red_fill(count * 2, std::byte{0x5a});
  B red_send(count * 2), red_recv(count * 2), red_inout(count * sizeof(float));
  red_send.write(rank_data<float16>(s6, rk, count).data(), count * 2, 0);
  red_recv.write(red_fill.data(), count * 2, 0);
  red_inout.write(rank_data<float>(s7, rk, count).data(), count * sizeof(float), 0);

  // All outstanding at once, then waited for in reverse order.
  std::vector<comm_handle> handles;
  handles.push_back(comm.allreduce_async(ar.data(), count, dtype::f32, reduce_op::sum));
  handles.push_back(comm.reduce_async(red_send.data(), red_recv.data(), count, dtype::f16, reduce_op::min, 0));
  handles.push_back(comm.allgather_async(ag_send.data(), ag_recv.data(), bytes));
  handles.push_back(comm.reduce_scatter_async(rs_send.data(), rs_recv.data(), count, dtype::bf16, reduce_op::max));
  handles.push_back(comm.broadcast_async(bc.data(), bytes, n - 1));
  handles.push_back(comm.reduce_async(red_inout.data(), red_inout.data(), count, dtype::f32, reduce_op::sum, n - 1));
  handles.push_back(comm.ring_shift_async(rs_a.data(), rs_b.data(), bytes));
  handles.push_back(comm.allreduce_async(std::span<double>(scalars), reduce_op::sum));
  for (auto it = handles.rbegin(); it != handles.rend(); ++it) it->wait();
  bool all_ready = true;
  for (auto& h : handles) all_ready = all_ready && h.ready();
  const std::string where = "eight async collectives outstanding at once, on rank " + std::to_string(rk);
  r.expect(all_ready, where + ": a handle is not ready() after wait()");

  const auto want_ar = reference<float>(s1, n, count, reduce_op::sum);
  r.expect(first_bad(ar.read(), want_ar, exact, abs_sum<float>(s1, n, count), n) == count, where + ": allreduce wrong");
  std::vector<std::byte> want_ag;
  for (int k = 0; k < n; ++k) {
    const auto part = rank_bytes(s2, k, bytes);
    want_ag.insert(want_ag.end(), part.begin(), part.end());
  }
  r.expect(ag_recv.read() == want_ag, where + ": allgather wrong");
  const auto full = reference<bfloat16>(s3, n, count * nn, reduce_op::max);
  const auto me = static_cast<std::size_t>(rk);
  const std::vector<bfloat16> want_rs(full.begin() + static_cast<std::ptrdiff_t>(me * count),
                                      full.begin() + static_cast<std::ptrdiff_t>((me + 1) * count));
  // max is order-free: exact on every model.
  r.expect(first_bad(rs_recv.read(), want_rs, true, {}, n) == count, where + ": reduce_scatter (max) wrong");
  r.expect(bc.read() == rank_bytes(s4, n - 1, bytes), where + ": broadcast wrong");
  if (rk == 0)  // min is order-free: exact on every model
    r.expect(first_bad(red_recv.read(), reference<float16>(s6, n, count, reduce_op::min), true, {}, n) == count,
             where + ": reduce (f16 min) to root 0 wrong");
  else r.expect(red_recv.read() == red_fill, where + ": reduce to root 0 wrote recv on another rank");
  const auto red_mine = rank_data<float>(s7, rk, count);
  if (rk == n - 1)
    r.expect(first_bad(red_inout.read(), reference<float>(s7, n, count, reduce_op::sum), exact,
                       abs_sum<float>(s7, n, count), n) == count,
             where + ": reduce (f32 sum, in place) to root n-1 wrong");
  else
    r.expect(first_bad(red_inout.read(), red_mine, true, {}, n) == count,
             where + ": reduce in place to root n-1 changed the buffer of another rank");
  r.expect(rs_b.read() == rank_bytes(s5, (rk - 1 + n) % n, bytes), where + ": ring_shift wrong");
  const double tri = double(n) * double(n - 1) / 2.0;
  r.expect(scalars[0] == tri && scalars[1] == double(n) && scalars[2] == -tri,
           where + ": allreduce(span<double>) wrong");

  comm_handle empty;
  r.expect(empty.ready(), "a default-constructed comm_handle is not ready()");
  empty.wait();
  comm_handle moved = comm.allreduce_async(ar.data(), 1, dtype::f32, reduce_op::max);
  comm_handle target = std::move(moved);
  r.expect(moved.ready(), "a moved-from comm_handle is not ready()");  // NOLINT(bugprone-use-after-move)
  target.wait();
  r.expect(target.ready(), "a comm_handle is not ready() after wait()");
}

template <class B, class C>
void determinism_checks(conformance_report& r, C& comm) {
  const int n = comm.size();
  const int rk = comm.rank();
  const std::size_t count = 4096;
  const std::uint64_t seed = 424242;
  // The data makes the fold order observable: with 3+ ranks some element's reversed-order sum
  // differs, so a model that reduced in another order would fail the reference checks.
  if (n >= 3) {
    const auto fwd = reference<float>(seed, n, count, reduce_op::sum);
    const auto rev = reference<float>(seed, n, count, reduce_op::sum, true);
    r.expect(std::memcmp(fwd.data(), rev.data(), count * sizeof(float)) != 0,
             "internal: the test data does not make the reduction order observable");
  }
  B a(count * sizeof(float)), b(count * sizeof(float));
  a.write(rank_data<float>(seed, rk, count).data(), count * sizeof(float), 0);
  b.write(rank_data<float>(seed, rk, count).data(), count * sizeof(float), 0);
  comm.allreduce(a.data(), count, dtype::f32, reduce_op::sum);
  comm.allreduce(b.data(), count, dtype::f32, reduce_op::sum);
  r.expect(a.read() == b.read(),
           "allreduce of the same inputs twice gave different bits on rank " + std::to_string(rk));
  B all(count * sizeof(float) * static_cast<std::size_t>(n));
  comm.allgather(a.data(), all.data(), count * sizeof(float));
  const auto everything = all.read();
  const auto mine = a.read();
  bool same = true;
  for (int k = 0; k < n; ++k)
    if (std::memcmp(everything.data() + static_cast<std::size_t>(k) * mine.size(), mine.data(), mine.size()) != 0)
      same = false;
  r.expect(same, "allreduce results differ between ranks (seen from rank " + std::to_string(rk) + ")");
}

template <class B, class C>
void rank_size_checks(conformance_report& r, C& comm) {
  const int n = comm.size();
  const int rk = comm.rank();
  r.expect(n >= 1, "size() is " + std::to_string(n) + ", not >= 1");
  r.expect(rk >= 0 && rk < n, "rank() is " + std::to_string(rk) + ", not in [0, size() = " + std::to_string(n) + ")");
  const std::int32_t me = rk;
  const std::size_t ranks_n = n >= 1 ? static_cast<std::size_t>(n) : 1;
  B send(sizeof me), recv(sizeof me * ranks_n);
  send.write(&me, sizeof me, 0);
  comm.allgather(send.data(), recv.data(), sizeof me);
  const auto got = recv.read();
  std::vector<std::int32_t> ranks(ranks_n);
  std::memcpy(ranks.data(), got.data(), std::min(got.size(), ranks.size() * sizeof(std::int32_t)));
  for (int k = 0; k < n; ++k)
    r.expect(ranks[static_cast<std::size_t>(k)] == k, [&] {
      return "allgather of rank(): block " + std::to_string(k) + " holds " +
             std::to_string(ranks[static_cast<std::size_t>(k)]) + " (ranks must be distinct, in order)";
    });
  for (int i = 0; i < 3; ++i) comm.barrier();
  // Argument errors are thrown at the call, identically on every model.
  B buf(64);
  auto* p = static_cast<std::byte*>(buf.data());
  expect_config_error(
      r, [&] { comm.allgather(p, p + 1, 8); }, "allgather with send overlapping recv other than in place");
  expect_config_error(
      r, [&] { comm.allreduce(nullptr, 4, dtype::f32, reduce_op::sum); }, "allreduce of 4 elements at nullptr");
}

}  // namespace comm_detail

/** @brief Checks the `Communicator` requirements (see the file comment) on this rank's @p comm;
 *  call it on every rank of the group at once. @p Buffer is memory @p comm's collectives take. */
template <class Buffer = host_buffer, Communicator C>
requires communicator_buffer<Buffer>
[[nodiscard]] conformance_report check_communicator(C& comm, const communicator_conformance_options& o = {}) {
  conformance_report r;
  r.subject = "Communicator (rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + ")";
  auto wanted = [&](communicator_check c) {
    return o.only.empty() || std::find(o.only.begin(), o.only.end(), c) != o.only.end();
  };
  if (wanted(communicator_check::rank_size)) comm_detail::rank_size_checks<Buffer>(r, comm);
  if (wanted(communicator_check::allreduce)) comm_detail::allreduce_checks<Buffer>(r, comm, o.exact);
  if (wanted(communicator_check::allreduce_f64)) comm_detail::allreduce_f64_checks(r, comm, o.exact);
  if (wanted(communicator_check::reduce_scatter)) comm_detail::reduce_scatter_checks<Buffer>(r, comm, o.exact);
  if (wanted(communicator_check::reduce)) comm_detail::reduce_checks<Buffer>(r, comm, o.exact);
  if (wanted(communicator_check::allgather)) comm_detail::allgather_checks<Buffer>(r, comm);
  if (wanted(communicator_check::broadcast)) comm_detail::broadcast_checks<Buffer>(r, comm);
  if (wanted(communicator_check::ring_shift)) comm_detail::ring_shift_checks<Buffer>(r, comm);
  if (wanted(communicator_check::async)) comm_detail::async_checks<Buffer>(r, comm, o.exact);
  if (wanted(communicator_check::determinism)) comm_detail::determinism_checks<Buffer>(r, comm);
  return r;
}

}  // namespace chunkstar::testing
