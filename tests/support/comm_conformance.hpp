// The Communicator conformance suite: written once, instantiated for every model.
//
// A fixture F provides:
//   static void run(Body body)  — calls body(comm) once on every rank, comm being a Communicator;
//   using buffer = ...          — memory the model's collectives take: buffer(bytes), data(),
//                                 write(const void*, bytes, offset = 0), read() -> vector<byte>;
//   static constexpr bool exact — reductions are the bit-exact rank-order fold (false: NCCL with
//                                 several ranks, checked to reduction-order tolerance instead).
// Instantiate with CHUNKSTAR_COMM_CONFORMANCE(fixture types...).
//
// Every check uses CHECK (never REQUIRE), so all ranks always issue the same collectives: a
// failed expectation on one rank must not desynchronise the others.
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::comm_test {

/** @brief Host memory as a fixture buffer. */
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

// ---- deterministic test data: every rank can compute every rank's input ----------------------

inline std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/** @brief A value with a full mantissa and exponents 2^-4..2^4, so sums round and order shows. */
inline float test_value(std::uint64_t seed, int rank, std::size_t i) {
  const std::uint64_t h = mix(mix(seed) ^ mix(static_cast<std::uint64_t>(rank) + 1000) ^ (i * 0x2545f4914f6cdd1dull));
  const float mantissa = 0.5f + static_cast<float>(h & 0xffffffu) / 16777216.0f;
  const int exponent = static_cast<int>((h >> 24) % 9) - 4;
  const float v = std::ldexp(mantissa, exponent);
  return ((h >> 40) & 1u) ? -v : v;
}

template <class T>
std::vector<T> rank_data(std::uint64_t seed, int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = from_float<T>(test_value(seed, rank, i));
  return v;
}

inline std::vector<std::byte> rank_bytes(std::uint64_t seed, int rank, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(mix(seed * 31 + static_cast<std::uint64_t>(rank) * 7919 + i) & 0xff);
  return v;
}

// ---- independent reference of the specified reduction -------------------------------------

/** @brief Rank order 0..N-1, in float (F = double for the double overload), rounded once. */
template <class F>
F combine_ref(F acc, F x, reduce_op op) {
  if (op == reduce_op::sum) return acc + x;
  if (op == reduce_op::max) return std::isnan(acc) ? acc : std::isnan(x) ? x : (acc < x ? x : acc);
  return std::isnan(acc) ? acc : std::isnan(x) ? x : (x < acc ? x : acc);
}

/** @brief The reduction over `nranks` ranks of `rank_data<T>(seed, k, n)`; `reverse` folds in
 *  the opposite order (to show that the order is observable). */
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
    float acc = to_float(all[reverse ? nranks - 1 : 0][i]);
    for (int j = 1; j < nranks; ++j) acc = combine_ref(acc, to_float(all[reverse ? nranks - 1 - j : j][i]), op);
    out[i] = from_float<T>(acc);
  }
  return out;
}

/** @brief Sum of |x| over ranks in double: the scale for tolerance checks. */
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

/** @brief Index of the first element where `got` differs from `want` (bitwise when exact,
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
         " count=" + std::to_string(count) + " rank " + std::to_string(rank) + "/" + std::to_string(size);
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

// ---- the checks, one function per collective ---------------------------------------------

template <class F, class T, class Comm>
void check_allreduce_one(Comm& comm, std::size_t count, reduce_op op, bool async, std::uint64_t seed) {
  const int n = comm.size();
  const auto mine = rank_data<T>(seed, comm.rank(), count);
  typename F::buffer buf(count * sizeof(T));
  buf.write(mine.data(), count * sizeof(T));
  if (async) {
    comm_handle h = comm.allreduce_async(buf.data(), count, dtype_of_v<T>, op);
    h.wait();
    CHECK(h.ready());
  } else {
    comm.allreduce(buf.data(), count, dtype_of_v<T>, op);
  }
  const auto want = reference<T>(seed, n, count, op);
  const std::size_t bad = first_bad(buf.read(), want, F::exact, abs_sum<T>(seed, n, count), n);
  CHECK_MESSAGE(bad == count, describe(async ? "allreduce_async" : "allreduce", dtype_of_v<T>, op, count, comm.rank(), n),
                " first wrong element ", bad);
}

template <class F>
void allreduce_suite(bool async) {
  F::run([&](auto& comm) {
    std::uint64_t seed = 11;
    for_each_dtype([&](auto tag) {
      using T = decltype(tag);
      for (reduce_op op : all_ops)
        for (std::size_t count : reduce_counts) check_allreduce_one<F, T>(comm, count, op, async, ++seed);
    });
  });
}

template <class F>
void allreduce_double_suite() {
  F::run([&](auto& comm) {
    const int n = comm.size();
    std::uint64_t seed = 101;
    for (reduce_op op : all_ops) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{64}}) {
        for (bool async : {false, true}) {
          ++seed;
          auto value = [&](int k, std::size_t i) { return static_cast<double>(test_value(seed, k, i)) * (1.0 + 0x1p-40 * double(i)); };
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
            const bool ok = F::exact ? std::memcmp(&acc, &v[i], sizeof(double)) == 0
                                     : std::fabs(acc - v[i]) <= 4.0 * n * 0x1p-53 * scale;
            if (!ok) bad = i;
          }
          CHECK_MESSAGE(bad == count, "allreduce(span<double>) ", reduce_op_name(op), " count=", count, " async=", async,
                        " rank ", comm.rank(), " first wrong element ", bad);
        }
      }
    }
  });
}

template <class F>
void reduce_scatter_suite(bool async) {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    std::uint64_t seed = 1000;
    for_each_dtype([&](auto tag) {
      using T = decltype(tag);
      for (reduce_op op : all_ops) {
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{17}}) {
          for (bool in_place : {false, true}) {
            ++seed;
            const std::size_t total = count * static_cast<std::size_t>(n);
            const auto mine = rank_data<T>(seed, r, total);
            typename F::buffer send(total * sizeof(T));
            send.write(mine.data(), total * sizeof(T));
            typename F::buffer recv(count * sizeof(T));
            void* out = in_place ? static_cast<std::byte*>(send.data()) + static_cast<std::size_t>(r) * count * sizeof(T)
                                 : recv.data();
            if (async) {
              comm_handle h = comm.reduce_scatter_async(send.data(), out, count, dtype_of_v<T>, op);
              h.wait();
            } else {
              comm.reduce_scatter(send.data(), out, count, dtype_of_v<T>, op);
            }
            std::vector<std::byte> got = in_place ? send.read() : recv.read();
            if (in_place) got.erase(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count * sizeof(T)));
            got.resize(count * sizeof(T));
            const auto full = reference<T>(seed, n, total, op);
            const std::vector<T> want(full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count),
                                      full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r + 1) * count));
            const auto scale_full = abs_sum<T>(seed, n, total);
            const std::vector<double> scale(scale_full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count),
                                            scale_full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r + 1) * count));
            const std::size_t bad = first_bad(got, want, F::exact, scale, n);
            CHECK_MESSAGE(bad == count, describe("reduce_scatter", dtype_of_v<T>, op, count, r, n), " in_place=", in_place,
                          " async=", async, " first wrong element ", bad);
            if (in_place) {  // the other blocks of send are untouched
              const auto after = send.read();
              bool others_kept = true;
              for (int k = 0; k < n; ++k) {
                if (k == r) continue;
                const std::size_t off = static_cast<std::size_t>(k) * count * sizeof(T);
                if (count != 0 && std::memcmp(after.data() + off, reinterpret_cast<const std::byte*>(mine.data()) + off,
                                              count * sizeof(T)) != 0)
                  others_kept = false;
              }
              CHECK_MESSAGE(others_kept, "in-place reduce_scatter changed another rank's block of send");
            }
          }
        }
      }
    });
  });
}

template <class F>
void allgather_suite(bool async) {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    std::uint64_t seed = 5000;
    for (std::size_t bytes : byte_counts) {
      for (bool in_place : {false, true}) {
        ++seed;
        const auto mine = rank_bytes(seed, r, bytes);
        typename F::buffer send(bytes);
        send.write(mine.data(), bytes);
        typename F::buffer recv(bytes * static_cast<std::size_t>(n));
        if (in_place) recv.write(mine.data(), bytes, static_cast<std::size_t>(r) * bytes);
        const void* src = in_place ? static_cast<const std::byte*>(recv.data()) + static_cast<std::size_t>(r) * bytes : send.data();
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
        CHECK_MESSAGE(recv.read() == want, "allgather bytes=", bytes, " in_place=", in_place, " async=", async, " rank ", r);
      }
    }
  });
}

template <class F>
void broadcast_suite(bool async) {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    std::uint64_t seed = 7000;
    for (int root = 0; root < n; ++root) {
      for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{4096}}) {
        ++seed;
        const auto mine = rank_bytes(seed, r, bytes);
        typename F::buffer buf(bytes);
        buf.write(mine.data(), bytes);
        if (async) {
          comm_handle h = comm.broadcast_async(buf.data(), bytes, root);
          h.wait();
        } else {
          comm.broadcast(buf.data(), bytes, root);
        }
        CHECK_MESSAGE(buf.read() == rank_bytes(seed, root, bytes), "broadcast bytes=", bytes, " root=", root, " rank ", r);
      }
    }
    typename F::buffer buf(8);
    CHECK_THROWS_AS(comm.broadcast(buf.data(), 8, n), config_error);
    CHECK_THROWS_AS(comm.broadcast(buf.data(), 8, -1), config_error);
  });
}

template <class F>
void ring_shift_suite(bool async) {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    const int prev = (r - 1 + n) % n;
    std::uint64_t seed = 9000;
    for (std::size_t bytes : byte_counts) {
      ++seed;
      // One step: receive the predecessor's bytes.
      typename F::buffer a(bytes), b(bytes);
      a.write(rank_bytes(seed, r, bytes).data(), bytes);
      if (async) {
        comm_handle h = comm.ring_shift_async(a.data(), b.data(), bytes);
        h.wait();
      } else {
        comm.ring_shift(a.data(), b.data(), bytes);
      }
      CHECK_MESSAGE(b.read() == rank_bytes(seed, prev, bytes), "ring_shift bytes=", bytes, " rank ", r);
      CHECK_MESSAGE(a.read() == rank_bytes(seed, r, bytes), "ring_shift modified send, rank ", r);
      // n steps, ping-ponging two buffers, bring every shard home; each step k holds rank r-k's.
      typename F::buffer* cur = &a;
      typename F::buffer* nxt = &b;
      bool every_step_right = true;
      for (int step = 1; step <= n; ++step) {
        comm.ring_shift(cur->data(), nxt->data(), bytes);
        if (nxt->read() != rank_bytes(seed, ((r - step) % n + n) % n, bytes)) every_step_right = false;
        std::swap(cur, nxt);
      }
      CHECK_MESSAGE(every_step_right, "ring_shift step holds the wrong shard, bytes=", bytes, " rank ", r);
      CHECK_MESSAGE(cur->read() == rank_bytes(seed, r, bytes), "ring_shift x size() did not come home, bytes=", bytes);
    }
    // Overlapping send/recv is refused at the call, before any communication.
    typename F::buffer buf(64);
    auto* p = static_cast<std::byte*>(buf.data());
    CHECK_THROWS_AS(comm.ring_shift(p, p, 32), config_error);
    CHECK_THROWS_AS(comm.ring_shift(p, p + 16, 32), config_error);
    CHECK_THROWS_AS(comm.ring_shift_async(p + 16, p, 32), config_error);
    comm.ring_shift(p, p + 32, 32);  // adjacent, not overlapping: fine
  });
}

template <class F>
void async_overlap_suite() {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    const std::size_t count = 129, bytes = 77;
    const std::uint64_t s1 = 301, s2 = 302, s3 = 303, s4 = 304, s5 = 305;
    typename F::buffer ar(count * sizeof(float));
    ar.write(rank_data<float>(s1, r, count).data(), count * sizeof(float));
    typename F::buffer ag_send(bytes), ag_recv(bytes * static_cast<std::size_t>(n));
    ag_send.write(rank_bytes(s2, r, bytes).data(), bytes);
    typename F::buffer rs_send(count * static_cast<std::size_t>(n) * 2), rs_recv(count * 2);
    rs_send.write(rank_data<bfloat16>(s3, r, count * static_cast<std::size_t>(n)).data(), count * static_cast<std::size_t>(n) * 2);
    typename F::buffer bc(bytes);
    bc.write(rank_bytes(s4, r, bytes).data(), bytes);
    typename F::buffer rs_a(bytes), rs_b(bytes);
    rs_a.write(rank_bytes(s5, r, bytes).data(), bytes);
    std::vector<double> scalars{double(r), 1.0, -double(r)};

    // All outstanding at once, then waited for in reverse order.
    std::vector<comm_handle> handles;
    handles.push_back(comm.allreduce_async(ar.data(), count, dtype::f32, reduce_op::sum));
    handles.push_back(comm.allgather_async(ag_send.data(), ag_recv.data(), bytes));
    handles.push_back(comm.reduce_scatter_async(rs_send.data(), rs_recv.data(), count, dtype::bf16, reduce_op::max));
    handles.push_back(comm.broadcast_async(bc.data(), bytes, n - 1));
    handles.push_back(comm.ring_shift_async(rs_a.data(), rs_b.data(), bytes));
    handles.push_back(comm.allreduce_async(std::span<double>(scalars), reduce_op::sum));
    CHECK(handles.size() == 6);
    for (auto it = handles.rbegin(); it != handles.rend(); ++it) it->wait();
    for (auto& h : handles) CHECK(h.ready());

    const auto want_ar = reference<float>(s1, n, count, reduce_op::sum);
    CHECK(first_bad(ar.read(), want_ar, F::exact, abs_sum<float>(s1, n, count), n) == count);
    std::vector<std::byte> want_ag;
    for (int k = 0; k < n; ++k) {
      const auto part = rank_bytes(s2, k, bytes);
      want_ag.insert(want_ag.end(), part.begin(), part.end());
    }
    CHECK(ag_recv.read() == want_ag);
    const auto full = reference<bfloat16>(s3, n, count * static_cast<std::size_t>(n), reduce_op::max);
    const std::vector<bfloat16> want_rs(full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count),
                                        full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r + 1) * count));
    CHECK(first_bad(rs_recv.read(), want_rs, true, {}, n) == count);  // max is order-free: exact everywhere
    CHECK(bc.read() == rank_bytes(s4, n - 1, bytes));
    CHECK(rs_b.read() == rank_bytes(s5, (r - 1 + n) % n, bytes));
    const double tri = double(n) * double(n - 1) / 2.0;
    CHECK(scalars[0] == tri);
    CHECK(scalars[1] == double(n));
    CHECK(scalars[2] == -tri);

    comm_handle empty;
    CHECK(empty.ready());
    empty.wait();
    comm_handle moved = comm.allreduce_async(ar.data(), 1, dtype::f32, reduce_op::max);
    comm_handle target = std::move(moved);
    CHECK(moved.ready());  // NOLINT(bugprone-use-after-move): a moved-from handle is complete
    target.wait();
    CHECK(target.ready());
  });
}

template <class F>
void determinism_suite() {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    const std::size_t count = 4096;
    const std::uint64_t seed = 424242;
    // The data makes the fold order observable: with 3+ ranks some element's reversed-order sum
    // differs, so a model that reduced in another order would fail the reference checks.
    if (n >= 3) {
      const auto fwd = reference<float>(seed, n, count, reduce_op::sum);
      const auto rev = reference<float>(seed, n, count, reduce_op::sum, true);
      CHECK(std::memcmp(fwd.data(), rev.data(), count * sizeof(float)) != 0);
    }
    // Bit-identical on every rank, and on a repeat.
    typename F::buffer a(count * sizeof(float)), b(count * sizeof(float));
    a.write(rank_data<float>(seed, r, count).data(), count * sizeof(float));
    b.write(rank_data<float>(seed, r, count).data(), count * sizeof(float));
    comm.allreduce(a.data(), count, dtype::f32, reduce_op::sum);
    comm.allreduce(b.data(), count, dtype::f32, reduce_op::sum);
    CHECK(a.read() == b.read());
    typename F::buffer all(count * sizeof(float) * static_cast<std::size_t>(n));
    comm.allgather(a.data(), all.data(), count * sizeof(float));
    const auto everything = all.read();
    const auto mine = a.read();
    bool same = true;
    for (int k = 0; k < n; ++k)
      if (std::memcmp(everything.data() + static_cast<std::size_t>(k) * mine.size(), mine.data(), mine.size()) != 0) same = false;
    CHECK_MESSAGE(same, "allreduce results differ between ranks (rank ", r, ")");
  });
}

template <class F>
void rank_size_suite() {
  F::run([&](auto& comm) {
    const int n = comm.size();
    const int r = comm.rank();
    CHECK(n >= 1);
    CHECK(r >= 0);
    CHECK(r < n);
    const std::int32_t me = r;
    typename F::buffer send(sizeof me), recv(sizeof me * static_cast<std::size_t>(n));
    send.write(&me, sizeof me);
    comm.allgather(send.data(), recv.data(), sizeof me);
    const auto got = recv.read();
    std::vector<std::int32_t> ranks(static_cast<std::size_t>(n));
    std::memcpy(ranks.data(), got.data(), got.size());
    for (int k = 0; k < n; ++k) CHECK(ranks[static_cast<std::size_t>(k)] == k);
    for (int i = 0; i < 3; ++i) comm.barrier();
    // Argument errors are thrown at the call, identically on every model.
    typename F::buffer buf(64);
    auto* p = static_cast<std::byte*>(buf.data());
    CHECK_THROWS_AS(comm.allgather(p, p + 1, 8), config_error);
    CHECK_THROWS_AS(comm.allreduce(nullptr, 4, dtype::f32, reduce_op::sum), config_error);
  });
}

}  // namespace chunkstar::comm_test

// clang-format off
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: rank, size, barrier, argument errors", F, chunkstar_comm_rank_size) {
  chunkstar::comm_test::rank_size_suite<F>();
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: allreduce matches the rank-order reference", F, chunkstar_comm_allreduce) {
  chunkstar::comm_test::allreduce_suite<F>(false);
  chunkstar::comm_test::allreduce_suite<F>(true);
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: allreduce of doubles", F, chunkstar_comm_allreduce_f64) {
  chunkstar::comm_test::allreduce_double_suite<F>();
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: reduce_scatter", F, chunkstar_comm_reduce_scatter) {
  chunkstar::comm_test::reduce_scatter_suite<F>(false);
  chunkstar::comm_test::reduce_scatter_suite<F>(true);
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: allgather", F, chunkstar_comm_allgather) {
  chunkstar::comm_test::allgather_suite<F>(false);
  chunkstar::comm_test::allgather_suite<F>(true);
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: broadcast", F, chunkstar_comm_broadcast) {
  chunkstar::comm_test::broadcast_suite<F>(false);
  chunkstar::comm_test::broadcast_suite<F>(true);
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: ring_shift", F, chunkstar_comm_ring_shift) {
  chunkstar::comm_test::ring_shift_suite<F>(false);
  chunkstar::comm_test::ring_shift_suite<F>(true);
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: several async handles outstanding", F, chunkstar_comm_async) {
  chunkstar::comm_test::async_overlap_suite<F>();
}
TEST_CASE_TEMPLATE_DEFINE("communicator conformance: deterministic, bit-identical across ranks", F, chunkstar_comm_determinism) {
  chunkstar::comm_test::determinism_suite<F>();
}
// clang-format on

/// Instantiates the whole suite for the given fixture types.
#define CHUNKSTAR_COMM_CONFORMANCE(...)                                 \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_rank_size, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_allreduce, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_allreduce_f64, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_reduce_scatter, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_allgather, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_broadcast, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_ring_shift, __VA_ARGS__);    \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_async, __VA_ARGS__);         \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_determinism, __VA_ARGS__)
