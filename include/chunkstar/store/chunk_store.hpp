// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_store`: the chunks (their slots: chunk_slots.hpp) and the mechanics that change
 *         them — allocate, move, zero-fill, pin, release, wait, retire the buffers finished copies
 *         read. It decides nothing: what moves where, and when, is the caller's.
 *
 *  Every operation gives the strong guarantee on the logical state (tier, payload, residency
 *  counters): it changes it after its last call that can throw. Decisions read only that state,
 *  never whether a copy has finished, so they are deterministic. The destructor waits for every
 *  copy and never throws. Built beside it: a tier below the host joins move() through `lower_tier`
 *  (the disk: disk_moves.hpp); chunk_values.hpp reads and writes values; ZeRO's group buffers
 *  (zero/group_buffers.hpp) live in its unslotted buffers; chunk_store_report.hpp reports. */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/observe/runtime_stats.hpp>
#include <chunkstar/store/chunk_pins.hpp>
#include <chunkstar/store/chunk_slots.hpp>
#include <chunkstar/store/chunk_store_report.hpp>
#include <chunkstar/store/lower_tier.hpp>
#include <chunkstar/store/retiring_buffers.hpp>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Why a chunk moves (counted separately in runtime_stats). */
enum class move_reason : std::uint8_t { load, evict, offload };

/** @brief The chunks of a runtime on platform @p P. */
template <Platform P>
class chunk_store : public chunk_slots<P> {
  using base = chunk_slots<P>;

 public:
  using typename base::copy_handle;
  using typename base::device_space_type;
  using typename base::slot;
  using host_space_type = typename P::host_space;
  using copy_engine_type = typename P::copy_engine;
  using stream_type = typename P::stream_type;
  using base::at, base::bytes_of, base::footprint, base::resident;
  using pin_set = chunk_pins<chunk_store>;

  /** @brief Whether host code may dereference compute-tier payloads (the simulated device). */
  static constexpr bool device_is_host_accessible = can_access_v<host_exec, device_space_type>;

  chunk_store(device_space_type& device, host_space_type& host, copy_engine_type& copier, std::size_t alignment,
              runtime_stats& stats)
      : base(device, alignment, stats), host_(host), copier_(copier) {}
  chunk_store(const chunk_store&) = delete;
  chunk_store& operator=(const chunk_store&) = delete;
  ~chunk_store();

  /** @brief Adds the tier below the host (before any chunk has a payload): chunks may then live on
   *  tier::disk, moved there and back by @p t (disk_moves.hpp: `attach_disk`). */
  void attach_lower(std::unique_ptr<lower_tier> t) noexcept {
    lower_ = std::move(t);
    this->whole_blocks_ = lower_ != nullptr;
  }
  [[nodiscard]] lower_tier* lower() const noexcept { return lower_.get(); }
  [[nodiscard]] bool has_disk() const noexcept { return lower_ != nullptr; }
  /** @brief The lower tier's capacity in bytes (0 without one). */
  [[nodiscard]] std::size_t disk_capacity() const { return lower_ ? lower_->space().capacity() : 0; }
  /** @brief Bytes of buffers on tier @p t that in-flight copies still read (freed when they land). */
  [[nodiscard]] std::size_t retiring(tier t) const noexcept {
    return retiring_.bytes_on(t, [&](tier w, std::size_t b) { return footprint(w, b); }) +
           (lower_ ? lower_->retiring(t) : 0);
  }

  /** @brief A chunk pinned where it is, for work on its payload outside a scope (a collective). */
  struct held_payload {
    pin_set pin;
    void* data = nullptr;
    std::size_t elems = 0;  ///< elements of the chunk (its capacity)
    dtype type = dtype::f32;
  };
  /** @brief Pins chunk @p id where it is, in memory (the runtime brings a FREE or disk chunk up
   *  first, making room), once its copy landed and the user's work on it finished. */
  [[nodiscard]] held_payload hold(chunk_id id) {
    if (at(id).where != tier::device && at(id).where != tier::host)
      throw state_error("internal: chunk " + to_string(id) + " has no payload in memory to hold; please report this");
    wait(id);
    wait_user(at(id));
    const auto& d = this->desc(id.kind);
    return {pin_set(*this, {id}), at(id).data, d.chunk_bytes / dtype_size(d.type), d.type};
  }

  // --- moves ---------------------------------------------------------------------------------------
  /** @brief Gives every chunk of every list but the gradients (FREE until first used) a zeroed
   *  payload at finalize, as allocate_initial(id); with @p sharded, only the chunks rank @p rank
   *  owns: the others are `remote`. */
  void allocate_initial(bool sharded = false, int rank = 0) {
    this->for_each([&](chunk_id id, slot& s) {
      if (sharded && s.owner != rank) s.where = tier::remote;
      else if (id.kind != chunk_kind::grad) allocate_initial(id);
    });
  }
  /** @brief Gives chunk @p id a zeroed payload at finalize: on the host, spilling to the device
   *  (then the lower tier) when the host is full (model data may exceed either tier alone). */
  void allocate_initial(chunk_id id);
  /** @brief Starts moving chunk @p id's payload to tier @p to. The logical tier changes at once;
   *  the old buffer retires when the copy lands. A device destination takes a free buffer when the
   *  device has room for it plus @p device_reserve bytes (what this moment's activations may still
   *  need), else the buffer of an eviction still in flight (the load ordered after it). A move to
   *  or from the lower tier is the lower tier's (lower_tier::move). @throws out_of_memory_error
   *  when @p to has no room; state_error if @p id is pinned. */
  void move(chunk_id id, tier to, move_reason why, std::size_t device_reserve = 0);
  /** @brief Gives FREE chunk @p id a zeroed payload on @p where: on the device zeroed by the copy
   *  engine's local lane (a memset off the critical path; the scope that uses it waits for it).
   *  @p device_reserve as for move(). */
  void materialise(chunk_id id, tier where, std::size_t device_reserve = 0);
  /** @brief Drops chunk @p id's payload (FREE; a gradient after its step). Waits for a copy into
   *  it first; a failed copy is dropped with the payload. */
  void release(chunk_id id) noexcept;

  // --- waits and retirement ------------------------------------------------------------------------
  /** @brief Waits until chunk @p id's payload has arrived (stall time counted); rethrows a failed
   *  copy. A failed lower-tier copy puts the chunk back where it was (lower_tier::resolve); after
   *  a failed device copy the payload is not valid and the chunk keeps its tier. */
  void wait(chunk_id id) { wait(at(id)); }
  void wait(slot& s);
  /** @brief Waits (on the host) for the user's work still using @p s's payload. */
  void wait_user(slot& s) {
    if (s.user_done) s.user_done->wait();
    s.user_done.reset();
  }
  /** @brief The user's work up to @p done uses chunk @p id's payload: its next move waits for it. */
  void order_after_user(chunk_id id, const copy_handle& done) { at(id).user_done = done; }
  /** @brief Frees the buffers of finished copies and forgets finished slot copies; never waits.
   *  @throws io_error (or corruption_error) for a finished lower-tier copy that failed: that chunk
   *  is back where it was, the others are retired. */
  void retire_completed();
  /** @brief Frees the buffers on tier @p t whose copies are done, or else waits for the oldest copy
   *  still reading one; false if no copy reads a buffer on @p t. */
  bool retire_one(tier t);
  /** @brief Ends chunk @p id's lower-tier copy, waiting for it (lower_tier::resolve). */
  void resolve_disk(chunk_id id) {
    if (at(id).disk_pending) lower_->resolve(id);
  }

  // --- buffers and payloads, for what is built beside the store ------------------------------------
  /** @brief A buffer of @p bytes on tier @p t, retiring finished copies (or waiting for one) until
   *  there is room; null when there is none. */
  void* allocate(tier t, std::size_t bytes) {
    for (;;)
      if (void* p = allocate_on(t, bytes); p != nullptr || !retire_one(t)) return p;
  }
  void deallocate(tier t, void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    bytes = footprint(t, bytes);
    if (t == tier::device) this->device_.deallocate(p, bytes, this->alignment_);
    else if (t == tier::disk) lower_->space().deallocate(p, bytes, this->alignment_);
    else host_.deallocate(p, bytes, this->alignment_);
  }
  /** @brief Chunk @p id's payload becomes @p data on @p to (an old one is the caller's to free),
   *  counted there; @p arrival: a new tick for `loaded_at`. */
  void relocate(chunk_id id, void* data, tier to, bool arrival) noexcept {
    auto& s = at(id);
    if (holds_payload(s.where)) this->count(s.where, bytes_of(id.kind), -1);
    s.data = data;
    s.where = to;
    if (arrival) s.loaded_at = this->tick();
    this->count(to, bytes_of(id.kind), +1);
  }
  /** @brief A device buffer outside any payload (a collective's), counted as unslotted and as
   *  collective memory until freed; null when the device has no room (after retiring copies). */
  void* allocate_unslotted(std::size_t bytes) {
    void* p = allocate(tier::device, bytes);
    if (p == nullptr) return nullptr;
    this->unslotted_ += bytes;
    this->collective_ += bytes;
    this->note_device_peak();
    this->note_model_peak();
    return p;
  }
  void free_unslotted(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    deallocate(tier::device, p, bytes);
    this->unslotted_ -= bytes;
    this->collective_ -= bytes;
  }
  /** @brief Chunk @p id (no payload) gets the chunk-sized part at @p p of an unslotted buffer as
   *  its device payload; unplace gives it back, the chunk becoming @p after. */
  void place(chunk_id id, void* p) noexcept {
    this->unslotted_ -= bytes_of(id.kind);  // first: the peaks never count it twice
    relocate(id, p, tier::device, true);
  }
  void unplace(chunk_id id, tier after) noexcept {
    auto& s = at(id);
    this->count(tier::device, bytes_of(id.kind), -1);
    s.data = nullptr;
    s.where = after;
    s.pending.reset();
    s.user_done.reset();
    this->unslotted_ += bytes_of(id.kind);
  }
  /** @brief Chunk @p id's placed payload becomes its own (freed with it, no longer collective). */
  void own(chunk_id id) noexcept { this->collective_ -= bytes_of(id.kind); }

  // --- reports -------------------------------------------------------------------------------------
  [[nodiscard]] std::vector<std::string> violations(bool pins_allowed, std::size_t non_model, bool sole_user) const {
    return chunk_store_violations(*this, pins_allowed, non_model, sole_user);
  }
  [[nodiscard]] memory_report report() const { return chunk_store_report(*this); }
  device_space_type& device() noexcept { return this->device_; }
  const device_space_type& device() const noexcept { return this->device_; }
  host_space_type& host() noexcept { return host_; }
  const host_space_type& host() const noexcept { return host_; }
  copy_engine_type& copier() noexcept { return copier_; }
  /** @brief Called with (submitted µs, source tier, destination tier) for each copy whose source retires. */
  std::function<void(double, tier, tier)> on_copy_retired;
  /** @brief Clock of the observer (µs), for copy spans; none: 0. */
  std::function<double()> clock;
  [[nodiscard]] double now_us() const noexcept {
    try {
      return clock ? clock() : 0.0;
    } catch (...) {
      return 0.0;
    }
  }

 private:
  using retiring_buffer = typename retiring_buffers<copy_handle>::entry;
  /** A buffer for a new payload; `reused`: the copy still reading it (taken over from an eviction). */
  struct buffer {
    void* p = nullptr;
    std::optional<copy_handle> reused;
  };

  void* allocate_on(tier t, std::size_t bytes) {
    bytes = footprint(t, bytes);
    if (t == tier::disk) return lower_ ? lower_->space().try_allocate(bytes, this->alignment_) : nullptr;
    return t == tier::device ? this->device_.try_allocate(bytes, this->alignment_)
                             : host_.try_allocate(bytes, this->alignment_);
  }
  void free_payload(slot& s, std::size_t bytes) noexcept {
    if (s.data == nullptr) return;
    deallocate(s.where, std::exchange(s.data, nullptr), bytes);
    s.where = tier::free;
  }
  /** Hands @p s's payload to the retiring buffers until the user's work on it is done; false (the
   *  payload untouched, that work waited for) when there is no room to remember it. */
  bool retire_after_user(slot& s, std::size_t bytes) noexcept;
  /** Frees a retiring buffer and reports its copy. */
  void release(retiring_buffer& r) noexcept {
    deallocate(r.where, std::exchange(r.buffer, nullptr), r.bytes);
    if (on_copy_retired && !r.user) {
      try {
        on_copy_retired(r.submitted_us, r.where, r.where == tier::device ? tier::host : tier::device);
      } catch (...) {  // an observer must not break memory management
      }
    }
  }
  /** Undoes getting @p b after a failure: a taken-over buffer goes back to retire with its copy
   *  (capacity was reserved), a fresh one is freed. */
  void give_back(buffer& b, tier t, std::size_t bytes) noexcept {
    if (b.p == nullptr) return;
    if (b.reused) retiring_.add({*b.reused, b.p, t, bytes, now_us()});
    else deallocate(t, b.p, bytes);
    b.p = nullptr;
  }
  /** A device buffer of @p bytes for a job on @p lane that never blocks the caller: a free one when
   *  the device has room for it and for @p reserve more bytes; else the buffer of the oldest
   *  eviction still in flight (same size), with @p lane ordered after that eviction's copy; else a
   *  free one if any. Null when none exists. */
  buffer device_buffer(std::size_t bytes, copy_direction lane, std::size_t reserve) {
    auto& device = this->device_;
    if (device.used() + bytes + reserve <= device.capacity())
      if (void* p = device.try_allocate(bytes, this->alignment_)) return {p, std::nullopt};
    if (auto* r = retiring_.oldest_on(tier::device, bytes)) {
      copier_.order_after(r->done, lane);
      ++this->stats_.buffer_reuses;
      return {std::exchange(r->buffer, nullptr), r->done};  // the eviction no longer frees it: it is ours
    }
    return {device.try_allocate(bytes, this->alignment_), std::nullopt};
  }

  host_space_type& host_;
  copy_engine_type& copier_;
  retiring_buffers<copy_handle> retiring_;  // buffers in-flight copies still read, oldest first
  std::unique_ptr<lower_tier> lower_;       // the tier below the host, when attached
};

template <Platform P>
chunk_store<P>::~chunk_store() {
  try {
    copier_.synchronize();
  } catch (...) {  // a failed copy was (or will never be) reported by its handle; free anyway
  }
  if (lower_) lower_->drain();
  retiring_.drain([&](retiring_buffer& r) { release(r); });
  for (auto& l : this->lists_)  // group members were given back by their owner (group_buffers)
    for (auto& s : l.chunks) free_payload(s, l.desc.chunk_bytes);
}

template <Platform P>
void chunk_store<P>::allocate_initial(chunk_id id) {
  const std::size_t bytes = bytes_of(id.kind);
  tier got = tier::host;
  void* p = allocate_on(tier::host, bytes);
  if (p == nullptr) p = allocate_on(got = tier::device, bytes);
  if (p == nullptr && lower_) p = allocate_on(got = tier::disk, bytes);
  if (p == nullptr)
    throw out_of_memory_error(
        "model data does not fit: a chunk of " + format_bytes(bytes) + " found no room on the host, the device" +
            (lower_ ? " or the disk" : " (and there is no disk tier)") + " (model data " +
            format_bytes(this->model_bytes()) + "). Raise the host space's capacity or the device space's" +
            (lower_ ? " or the disk's" : ", attach a disk tier") +
            ", use a smaller model, or fewer optimizer-state lists (runtime_options::optimizer_state)",
        bytes, report());
  try {
    if (got == tier::disk) lower_->zero(p, footprint(tier::disk, bytes));
    else if (got == tier::host || device_is_host_accessible) std::memset(p, 0, bytes);
    else copier_.zero_async(p, bytes).wait();
  } catch (...) {
    deallocate(got, p, bytes);
    throw;
  }
  relocate(id, p, got, true);
}

template <Platform P>
void chunk_store<P>::move(chunk_id id, tier to, move_reason why, std::size_t device_reserve) {
  auto& s = at(id);
  if (s.pinned)  // the invariant every caller must keep: a chunk in use never moves
    throw state_error("internal: chunk " + to_string(id) + " is in use and cannot move to the " +
                      std::string(tier_name(to)) + "; please report this as a chunkstar bug");
  if (!holds_payload(s.where)) throw state_error("internal: chunk " + to_string(id) + " has no payload to move");
  resolve_disk(id);  // a chunk moves on only from bytes known to be good
  if (to == tier::disk || s.where == tier::disk) {
    if (!lower_)
      throw state_error("internal: chunk " + to_string(id) +
                        " cannot move to or from the disk: no disk tier is attached");
    return lower_->move(id, to);
  }
  const std::size_t bytes = bytes_of(id.kind);
  const auto dir = to == tier::device ? copy_direction::to_device : copy_direction::to_host;
  retiring_.reserve(2);  // recording the copy (or giving back a buffer) cannot throw
  buffer dst = to == tier::device ? device_buffer(bytes, dir, device_reserve) : buffer{};
  if (dst.p == nullptr) dst.p = allocate(to, bytes);
  if (dst.p == nullptr) {
    std::string why;
    if (to == tier::device)
      why = ": the device is full of non-model data; raise the device space's capacity or lower the activation memory";
    else if (!lower_) why = ": host and device are both full; raise the host space's capacity";
    else  // the lower tier may have room, but everything on the host is in use or in transit
      why = lower_->why_host_full();
    throw out_of_memory_error("no room on the " + std::string(tier_name(to)) + " for chunk " + to_string(id) + " (" +
                                  format_bytes(bytes) + ")" + why,
                              bytes, report());
  }
  const double submitted_us = now_us();
  std::optional<copy_handle> h;
  try {
    // Ordered after what still uses the source: the user's work on it, and its own last copy.
    if (s.user_done) copier_.order_after(*s.user_done, dir);
    if (s.pending && !s.pending->ready()) copier_.order_after(*s.pending, dir);
    h = copier_.copy_async(dst.p, s.data, bytes, dir);
  } catch (...) {
    give_back(dst, to, bytes);
    throw;
  }
  retiring_.add({*h, s.data, s.where, bytes, submitted_us});
  s.pending = std::move(h);
  s.user_done.reset();
  relocate(id, dst.p, to, true);
  auto& st = this->stats_;
  (to == tier::device ? st.bytes_to_device : st.bytes_to_host) += bytes;
  ++(why == move_reason::load ? st.loads : why == move_reason::evict ? st.evictions : st.offloads);
}

template <Platform P>
void chunk_store<P>::materialise(chunk_id id, tier where, std::size_t device_reserve) {
  if (holds_payload(at(id).where)) throw state_error("internal: chunk " + to_string(id) + " already has a payload");
  const std::size_t bytes = bytes_of(id.kind);
  retiring_.reserve(1);
  buffer p = where == tier::device ? device_buffer(bytes, copy_direction::host_to_host, device_reserve) : buffer{};
  if (p.p == nullptr) p.p = allocate(where, bytes);
  if (p.p == nullptr)
    throw out_of_memory_error("no room on the " + std::string(tier_name(where)) + " for chunk " + to_string(id) + " (" +
                                  format_bytes(bytes) + "): raise that space's capacity",
                              bytes, report());
  std::optional<copy_handle> h;
  try {
    if (where == tier::device) h = copier_.zero_async(p.p, bytes);
    else std::memset(p.p, 0, bytes);
  } catch (...) {
    give_back(p, where, bytes);
    throw;
  }
  at(id).pending = std::move(h);
  relocate(id, p.p, where, true);
  ++this->stats_.materialised;
}

template <Platform P>
void chunk_store<P>::release(chunk_id id) noexcept {
  auto& s = at(id);
  if (!holds_payload(s.where) || s.group != nullptr) return;  // a group member goes with its group
  if (s.disk_pending) lower_->discard(id);
  if (s.pending) {
    try {
      s.pending->wait();
    } catch (...) {  // the payload is discarded: its copy's failure no longer matters
    }
    s.pending.reset();
  }
  this->count(s.where, bytes_of(id.kind), -1);
  // The user's work may still read it (an asynchronous optimizer step): it retires, freed
  // once that work is done, like a buffer an eviction in flight still reads.
  if (!(s.user_done && !s.user_done->ready() && retire_after_user(s, bytes_of(id.kind))))
    free_payload(s, bytes_of(id.kind));
  s.user_done.reset();
  s.prefetched = false;
}

template <Platform P>
void chunk_store<P>::wait(slot& s) {
  if (s.disk_pending) lower_->resolve(this->id_of(s));
  if (!s.pending) return;
  if (!s.pending->ready()) {
    const auto t0 = std::chrono::steady_clock::now();
    s.pending->wait();
    this->stats_.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  s.pending->wait();
  s.pending.reset();
}

template <Platform P>
void chunk_store<P>::retire_completed() {
  retiring_.release_done([&](retiring_buffer& r) { release(r); });
  std::exception_ptr failure;
  this->for_each([&](chunk_id id, slot& s) {
    if (s.disk_pending && s.disk_pending->done.ready()) {
      try {
        lower_->resolve(id);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    if (s.pending && s.pending->ready()) wait(s);
  });
  if (failure) std::rethrow_exception(failure);
}

template <Platform P>
bool chunk_store<P>::retire_one(tier t) {
  const auto before = retiring_.size(), held = retiring(t);
  retire_completed();
  if (retiring_.size() != before || retiring(t) != held) return true;
  if (auto* r = retiring_.oldest_on(t)) {
    const auto t0 = std::chrono::steady_clock::now();
    r->done.wait();
    this->stats_.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    retire_completed();
    return true;
  }
  return lower_ && lower_->resolve_one(t);  // a lower-tier copy still reading a payload on t
}

template <Platform P>
bool chunk_store<P>::retire_after_user(slot& s, std::size_t bytes) noexcept {
  if (s.data == nullptr) return false;
  try {
    retiring_.add({*s.user_done, s.data, s.where, bytes, now_us(), /*user=*/true});
  } catch (...) {
    try {
      s.user_done->wait();
    } catch (...) {  // the payload is discarded: the work's failure is the user's to see
    }
    return false;
  }
  s.data = nullptr;
  s.where = tier::free;
  return true;
}

}  // namespace chunkstar
