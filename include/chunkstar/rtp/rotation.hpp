// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::rotation`: the Rotated Tensor Parallelism schedule of one layer sharded N ways.
 *         Each rank owns one shard of the layer's weights and its gradient; a pass rotates the
 *         shards around the ring while the user's kernel computes with the one that is resident,
 *         and in backward a gradient buffer travels with each shard and arrives at its owner
 *         holding the sum over all ranks.
 *
 *  The schedule owns the buffers, the communication, the order and the overlap; the user owns the
 *  math (a kernel per step, given the resident shard's index and data). The order is
 *  rtp/ring_order.hpp's; docs/rtp.md has the whole picture.
 *
 *  Buffers (`shard_elems` elements of `T` each; host memory, or with an external shard wherever the
 *  `BufferOps` policy says, e.g. device memory with a CUDA stream's operations: rtp/buffer_ops.hpp):
 *  - owned: the rank's shard (`owned()`) and its gradient (`owned_grad()`). The optimizer steps
 *    these; the schedule never writes the owned weights and writes the owned gradient only at the
 *    very end of `backward`.
 *  - in transit (`transit_buffers`, the rotation's own or shared with the model's other
 *    rotations): two weight buffers (one resident, one receiving the next shard), two gradient
 *    buffers (one sending the partial sum on, one receiving the next) and one scratch buffer the
 *    kernel adds this rank's contribution into while a partial sum is still in flight. A shift
 *    never sends from and receives into the same buffer, and no kernel reads a buffer being
 *    received into or writes one being sent.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/rtp/buffer_ops.hpp>
#include <chunkstar/rtp/ring_order.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar::rtp {

/** @brief Tag for a rotation whose owned shard lives elsewhere (a chunk runtime, the caller's
 *  buffers): each pass loads it through a callback and hands the gradient sum to another. */
struct external_shard_t {
  explicit external_shard_t() = default;
};
/** @copydoc external_shard_t */
inline constexpr external_shard_t external_shard{};

/** @brief What one rotation's passes communicated and waited for, since construction or the last
 *  `reset_stats()` (see "Stats" in `rotation`). */
struct rotation_stats {
  std::uint64_t shifts = 0;      ///< ring shifts issued (forward N - 1, backward 2(N - 1) per pass)
  std::uint64_t bytes_sent = 0;  ///< bytes those shifts sent (= received): shifts x shard_bytes()
  double wait_s = 0;             ///< wall seconds spent in the waits for shifts
};

/** @brief The RTP schedule of one layer over communicator @p Comm, shards of `T` (float by default).
 *
 *  Every rank of the communicator builds one with the same `shard_elems`, fills `owned()` with its
 *  shard (for example with `counter_init`), and calls `forward` and `backward` in the same
 *  sequence (they issue ring shifts, which are collectives).
 *
 *  **forward(f)**: for s = 0..N-1, `f(j, shard)` with j = `forward_shard(rank, N, s)` and `shard`
 *  that shard's weights (read-only). The shift that brings the next shard is started before `f`
 *  and waited for after it, so communication overlaps the kernel. Step 0 computes with the owned
 *  shard, which is never overwritten: a forward-only pass (evaluation) leaves every rank's owned
 *  shard bit-unchanged, however many passes run. N - 1 shifts of one shard.
 *
 *  **backward(g)**: for t = 0..N-1, `g(j, shard, grad)` with j = `backward_shard(rank, N, t)`;
 *  `g` must *add* this rank's gradient contribution for shard j into `grad` (zeroed for it).
 *  Before step 0 shard rank-1 is fetched (the one shift not overlapped with a kernel). During
 *  step t the next weights and the partial gradient sum of shard j (the earlier ranks'
 *  contributions) arrive while `g` runs; after `g`, the partial plus this rank's contribution is
 *  sent on. At the last step the shard is the owned one, and `owned_grad()` is set to the sum over
 *  all ranks, added in the order `gradient_contributor(j, N, 0..N-1)` (the owner last), each
 *  rank's contribution being exactly what its kernel added to a zeroed buffer. So the result is
 *  bit-identical run to run. It replaces the previous `owned_grad()` (accumulate micro-batches in
 *  the kernel, or add `owned_grad()` into your own buffer after each backward). It is the
 *  gradient of the *sum* of the ranks' losses, as `reduce_replicated_grads` gives for replicated
 *  parameters. N - 1 weight shifts and N - 1 gradient shifts of one shard each.
 *
 *  With one rank neither pass communicates; backward calls `g` once on the owned shard.
 *
 *  **Exception safety.** If a kernel or the communicator throws, every shift already started is
 *  waited for (quietly: the first exception is the one that propagates) before the call returns,
 *  `owned()` and `owned_grad()` hold exactly what they held before the call, nothing is left in
 *  flight and the object can be used again (with a communicator still in step with its peers: a
 *  pass that failed on one rank left the ranks' collective sequences apart, which the in-process
 *  and MPI communicators report to the peers as `communication_error`). The destructor never
 *  throws and has nothing to wait for: no shift outlives the pass that started it.
 *
 *  **Stats.** `stats()` counts the shifts this object issued, the bytes they sent, and the wall
 *  time spent waiting for shifts to complete (steady_clock around each wait: forward's per-step
 *  waits, backward's exposed first fetch and its per-step waits), i.e. the communication the
 *  kernels did not hide. Two clock reads per step; with one rank nothing is issued and nothing is
 *  timed (all zero). After a throw they include what was issued and waited for before it; the
 *  quiet waits of an unwinding pass are not timed. `reset_stats()` zeroes them.
 *
 *  Not thread-safe; a kernel must not start a pass on the same object (`state_error`). A kernel
 *  may issue collectives of its own if every rank issues the same ones at the same step (they
 *  queue behind the shift in flight).
 *
 *  **Buffer memory** (`Ops`, rtp/buffer_ops.hpp). The schedule fills, sums and copies buffers only
 *  through `Ops`, and calls `Ops::settle()` before every shift, so with buffers in device memory
 *  and kernels queued on a stream no shift sends a buffer a kernel is still writing or overwrites
 *  one a kernel is still reading; a pass that fails settles before it returns. Kernels may return
 *  before they finish: the sum's order and bits are the same. A rotation that owns its shard keeps
 *  it in host vectors, so it needs `Ops::host_memory`; with other memory, build it with
 *  `external_shard`.
 */
template <Communicator Comm, shard_element T = float, BufferOps<T> Ops = host_buffer_ops<T>>
class rotation {
 public:
  using value_type = T;
  using ops_type = Ops;

  /** @brief A schedule for shards of @p shard_elems elements on @p comm (held by reference; it
   *  must outlive this object). Allocates the owned shard and gradient (zeroed) and its own transit
   *  buffers. Throws `config_error` for an empty shard. */
  rotation(Comm& comm, std::size_t shard_elems, Ops ops = Ops{}) requires(Ops::host_memory)
      : rotation(comm, shard_elems, std::make_unique<transit_buffers<T>>(), nullptr, false, std::move(ops)) {}

  /** @brief The same, with transit buffers shared with other rotations (held by reference; they
   *  must outlive this object, and the rotations sharing them must not run passes concurrently):
   *  grows them to this shard's size if they are smaller. */
  rotation(Comm& comm, std::size_t shard_elems, transit_buffers<T>& shared, Ops ops = Ops{}) requires(Ops::host_memory)
      : rotation(comm, shard_elems, std::unique_ptr<transit_buffers<T>>(), &shared, false, std::move(ops)) {}

  /** @brief A rotation that holds no owned shard: the caller keeps it (e.g. in a chunk runtime)
   *  and passes it in at each pass (`forward(load, f)`, `backward(load, g, store)`), so a rank's
   *  only memory for the rotation is the shared transit buffers (all five, even with one rank,
   *  where they hold the loaded shard). `owned()` and `owned_grad()` are empty. @p ops works on
   *  the memory of @p shared. */
  rotation(Comm& comm, std::size_t shard_elems, transit_buffers<T>& shared, external_shard_t, Ops ops = Ops{})
      : rotation(comm, shard_elems, std::unique_ptr<transit_buffers<T>>(), &shared, true, std::move(ops)) {}

 private:
  rotation(Comm& comm, std::size_t shard_elems, std::unique_ptr<transit_buffers<T>> own,
           transit_buffers<T>* shared = nullptr, bool external = false, Ops ops = Ops{})
      : comm_(comm),
        rank_(comm.rank()),
        world_(comm.size()),
        elems_(shard_elems),
        external_(external),
        own_(std::move(own)),
        pool_(shared ? shared : own_.get()),
        ops_(std::move(ops)) {
    if (shard_elems == 0)
      throw config_error("rtp::rotation: a shard of 0 elements; a sharded layer needs at least one element per rank");
    if (shard_elems > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw config_error("rtp::rotation: a shard of " + std::to_string(shard_elems) +
                         " elements overflows its byte size");
    if (!external_) {
      home_w_.assign(elems_, T{});
      home_g_.assign(elems_, T{});
    }
    pool_->reserve(elems_, world_ > 1 || external_);
  }

 public:
  rotation(const rotation&) = delete;
  rotation& operator=(const rotation&) = delete;
  ~rotation() = default;  // every pass waits for its shifts before it returns or unwinds

  /** @brief This rank, which is also the index of the shard it owns. */
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /** @brief Ranks in the ring, which is also the number of shards. */
  [[nodiscard]] int world() const noexcept { return world_; }
  /** @brief Elements per shard. */
  [[nodiscard]] std::size_t shard_elems() const noexcept { return elems_; }
  /** @brief Bytes per shard: what one weight or gradient shift sends. */
  [[nodiscard]] std::size_t shard_bytes() const noexcept { return elems_ * sizeof(T); }
  /** @brief Bytes of the transit buffers this rotation uses (two weight, two gradient and one
   *  scratch shard with more than one rank, the scratch alone with one): the per-rank memory RTP
   *  adds to the owned shard and gradient. Shared buffers are counted by every rotation sharing
   *  them (the model that shares them counts them once). */
  [[nodiscard]] std::size_t transient_bytes() const noexcept { return pool_->bytes(); }

  /** @brief Shifts, bytes and wait time of this object's passes (see the class comment). */
  [[nodiscard]] rotation_stats stats() const noexcept { return stats_; }
  /** @brief Zeroes `stats()`. */
  void reset_stats() noexcept { stats_ = {}; }

  /** @brief The owned shard (shard `rank()`): fill it before the first pass, step it after a
   *  backward. Stable address for the object's lifetime. */
  [[nodiscard]] std::span<T> owned() noexcept { return home_w_; }
  /** @copydoc owned() */
  [[nodiscard]] std::span<const T> owned() const noexcept { return home_w_; }
  /** @brief The owned shard's gradient, summed over all ranks by the last `backward`. */
  [[nodiscard]] std::span<T> owned_grad() noexcept { return home_g_; }
  /** @copydoc owned_grad() */
  [[nodiscard]] std::span<const T> owned_grad() const noexcept { return home_g_; }

  /** @brief Runs a forward pass: `f(shard_index, std::span<const T> shard)` once per shard, in
   *  `forward_shard` order (see the class comment). */
  template <class F>
  requires std::invocable<F&, int, std::span<const T>>
  void forward(F&& f) {
    require_own("forward");
    forward_impl([this](T*) -> const T* { return home_w_.data(); }, f);
  }

  /** @brief The forward pass of a rotation built with `external_shard`: `load(std::span<T> dst)`
   *  writes this rank's shard into `dst` (a transit buffer) at the start of the pass; then as
   *  `forward(f)`. */
  template <class L, class F>
  requires std::invocable<L&, std::span<T>> && std::invocable<F&, int, std::span<const T>>
  void forward(L&& load, F&& f) {
    require_external("forward");
    forward_impl(loader(load), f);
  }

  /** @brief Runs a backward pass: `g(shard_index, std::span<const T> shard, std::span<T> grad)`
   *  once per shard, in `backward_shard` order; `g` adds this rank's contribution to the shard's
   *  gradient into `grad`. Afterwards `owned_grad()` holds the sum over all ranks (see the class
   *  comment). */
  template <class G>
  requires std::invocable<G&, int, std::span<const T>, std::span<T>>
  void backward(G&& g) {
    require_own("backward");
    backward_impl([this](T*) -> const T* { return home_w_.data(); }, g,
                  [this](const T* sum) { ops_.copy(home_g_.data(), sum, elems_); });
  }

  /** @brief The backward pass of a rotation built with `external_shard`: `load(std::span<T> dst)`
   *  writes this rank's shard into `dst` (at the start, and again for the last step, where its
   *  own shard is needed once more), `g` as in `backward(g)`, and `store(std::span<const T> sum)`
   *  receives the gradient sum over all ranks once, after everything that can fail. */
  template <class L, class G, class S>
  requires std::invocable<L&, std::span<T>> && std::invocable<G&, int, std::span<const T>, std::span<T>> &&
      std::invocable<S&, std::span<const T>>
  void backward(L&& load, G&& g, S&& store) {
    require_external("backward");
    backward_impl(loader(load), g, [&](const T* sum) { std::invoke(store, std::span<const T>(sum, elems_)); });
  }

 private:
  /** Forward, with @p own_shard(spare) giving this rank's shard (the home buffer, or loaded into
   *  the free transit buffer @p spare). */
  template <class Own, class F>
  void forward_impl(Own&& own_shard, F& f) {
    const pass_guard guard(busy_, "forward");
    const settle_on_unwind settle(ops_);
    const T* resident = own_shard(world_ > 1 ? pool_->weights(1) : pool_->scratch());
    for (int s = 0; s < world_; ++s) {
      T* incoming = pool_->weights(static_cast<std::size_t>(s % 2));  // never `resident`: home, then alternating
      comm_handle next;                                               // waited for quietly if the kernel throws
      if (s + 1 < world_) next = shift(resident, incoming);
      std::invoke(f, forward_shard(rank_, world_, s), std::span<const T>(resident, elems_));
      if (s + 1 < world_) {
        const wait_timer timer(stats_.wait_s);
        next.wait();
      }
      resident = incoming;
    }
  }

  /** Backward, with @p own_shard as in forward_impl and @p finish(sum) called with the gradient
   *  sum once, after the last call that can throw. */
  template <class Own, class G, class Finish>
  void backward_impl(Own&& own_shard, G& g, Finish&& finish) {
    const pass_guard guard(busy_, "backward");
    const settle_on_unwind settle(ops_);
    if (world_ == 1) {
      T* scratch = pool_->scratch();
      const T* weights = own_shard(pool_->weights(0));
      ops_.zero(scratch, elems_);
      std::invoke(g, 0, std::span<const T>(weights, elems_), std::span<T>(scratch, elems_));
      finish(scratch);  // only after the kernel succeeded
      return;
    }
    T* const w[2] = {pool_->weights(0), pool_->weights(1)};
    T* const gb[2] = {pool_->grads(0), pool_->grads(1)};
    T* const scratch = pool_->scratch();
    {  // shard rank-1, for step 0: nothing computes yet, so only the zero fill overlaps it
      comm_handle first = shift(own_shard(w[1]), w[0]);
      ops_.zero(gb[0], elems_);
      const wait_timer timer(stats_.wait_s);
      first.wait();
    }
    comm_handle partial;  // the partial sum arriving for the current step (started after the previous kernel)
    for (int t = 0; t < world_; ++t) {
      const auto cur = static_cast<std::size_t>(t % 2), other = 1 - cur;
      const bool last = t == world_ - 1;
      // The last step needs this rank's own shard again; w[cur] is free then (its shard left at
      // step t - 2, and step t - 1 started no shift).
      const T* weights = last ? own_shard(w[cur]) : w[cur];
      comm_handle next_weights;
      if (t + 2 < world_) next_weights = shift(w[cur], w[other]);
      // Step 0's contribution is the sum's first term: the kernel adds straight into the buffer
      // that is sent on. Later steps add into the scratch while the partial sum is still arriving.
      T* acc = t == 0 ? gb[0] : scratch;
      if (t > 0) ops_.zero(scratch, elems_);
      std::invoke(g, backward_shard(rank_, world_, t), std::span<const T>(weights, elems_), std::span<T>(acc, elems_));
      {
        const wait_timer timer(stats_.wait_s);
        next_weights.wait();
        partial.wait();  // gb[cur] now holds the earlier ranks' sum for this shard
      }
      if (last) {
        // Handed over here only, after the last call that can throw: a failed pass leaves the
        // owned gradient (or the caller's) as it was.
        ops_.add(gb[cur], scratch, elems_);
        finish(gb[cur]);
        return;
      }
      if (t > 0) ops_.add(gb[cur], scratch, elems_);
      partial = shift(gb[cur], gb[other]);
    }
  }

 private:
  /** @brief Marks a pass in progress; a nested pass (a kernel calling back in) is a state_error. */
  class pass_guard {
   public:
    pass_guard(bool& busy, const char* what) : busy_(busy) {
      if (busy_)
        throw state_error(std::string("rtp::rotation::") + what +
                          ": a pass is already running on this object (a kernel called back into its schedule); "
                          "use one rotation object per layer and start passes from outside the kernels");
      busy_ = true;
    }
    pass_guard(const pass_guard&) = delete;
    pass_guard& operator=(const pass_guard&) = delete;
    ~pass_guard() { busy_ = false; }

   private:
    bool& busy_;
  };

  /** @brief Waits for the buffer operations and kernels queued on the buffers (the shift sends one
   *  and overwrites another), then starts a ring shift of one shard and counts it (only once
   *  issued: a call that throws sent nothing). */
  comm_handle shift(const T* send, T* recv) {
    ops_.settle();
    comm_handle h = comm_.ring_shift_async(send, recv, shard_bytes());
    ++stats_.shifts;
    stats_.bytes_sent += shard_bytes();
    return h;
  }

  /** @brief Settles the buffer operations when a pass unwinds, so no kernel or copy still uses the
   *  buffers after it returns; quietly (the first exception is the one that propagates). */
  class settle_on_unwind {
   public:
    explicit settle_on_unwind(Ops& ops) noexcept : ops_(ops), uncaught_(std::uncaught_exceptions()) {}
    settle_on_unwind(const settle_on_unwind&) = delete;
    settle_on_unwind& operator=(const settle_on_unwind&) = delete;
    ~settle_on_unwind() {
      if (std::uncaught_exceptions() == uncaught_) return;
      try {
        ops_.settle();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the pass's own exception is already on its way
      }
    }

   private:
    Ops& ops_;
    int uncaught_;
  };

  /** @brief Adds the wall time of its scope to a counter, also when a wait in it throws. */
  class wait_timer {
   public:
    explicit wait_timer(double& total) noexcept : total_(total), start_(std::chrono::steady_clock::now()) {}
    wait_timer(const wait_timer&) = delete;
    wait_timer& operator=(const wait_timer&) = delete;
    ~wait_timer() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

   private:
    double& total_;
    std::chrono::steady_clock::time_point start_;
  };

  template <class L>
  auto loader(L& load) {
    return [this, &load](T* dst) -> const T* {
      std::invoke(load, std::span<T>(dst, elems_));
      return dst;
    };
  }
  void require_own(const char* what) const {
    if (external_)
      throw state_error(
          std::string("rtp::rotation::") + what +
          ": this rotation was built with external_shard and holds no shard; pass the load (and store) callbacks");
  }
  void require_external(const char* what) const {
    if (!external_)
      throw state_error(
          std::string("rtp::rotation::") + what +
          ": load/store callbacks are for rotations built with external_shard; this one holds its shard (owned())");
  }

  Comm& comm_;
  int rank_;
  int world_;
  std::size_t elems_;
  bool external_ = false;
  std::vector<T> home_w_, home_g_;
  std::unique_ptr<transit_buffers<T>> own_;  // null when the transit buffers are shared
  transit_buffers<T>* pool_;
  Ops ops_;
  bool busy_ = false;
  rotation_stats stats_;
};

}  // namespace chunkstar::rtp
