// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `RuntimeObserver` concept — what a runtime reports as it goes (scopes, copies, the
 *         optimizer step, memory levels) — its non-owning type-erased reference `observer_ref`
 *         (null by default: then the runtime reports nothing and pays nothing), and
 *         `timeline_observer`, which records them as a Chrome-trace timeline.
 *
 *  Counters (bytes moved, evictions, stalls, peaks) are not an observer's job: the runtime keeps
 *  them in `runtime_stats`, always, because they are cheap and deterministic.
 */
#pragma once

#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/observe/timeline.hpp>

#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>

namespace chunkstar {

/** @brief The runtime's memory levels at one instant, in bytes. */
struct memory_levels {
  std::size_t device_chunks = 0;  ///< chunk payloads on the compute tier (logical)
  std::size_t host_chunks = 0;    ///< chunk payloads on the host
  std::size_t non_model = 0;      ///< non-model memory on the compute tier
  std::size_t disk_chunks = 0;    ///< chunk payloads on the disk tier
};

/** @brief The `RuntimeObserver` concept.
 *
 *  Required expressions, for `o` an `O&`, `k` a `moment_kind`, `n` a `std::string_view`, `t` a
 *  `tier`, `b`, `e` `double` (µs on the observer's clock), `l` a `const memory_levels&`:
 *  1. `o.now_us()` → `double`: the observer's clock, microseconds.
 *  2. `o.on_scope_open(k, n, b, e)`: a scope (or a step's chunk) spent [b, e) making its chunks resident.
 *  3. `o.on_scope_close(k, n, b, e)`: a scope was open (user compute) during [b, e).
 *  4. `o.on_copy(t, b, e)`: a chunk copy out of tier `t` ran during [b, e) (seen when its buffer
 *     retired). Optional: `o.on_copy(from, to, b, e)`, called instead when the observer has it, for
 *     every copy including those between the host and a disk tier (which the three-argument form
 *     does not see: a copy out of the host could go either way).
 *  5. `o.on_step(b, e)`: an optimizer step ran during [b, e).
 *  6. `o.on_memory(l)`: the memory levels changed.
 *  Calls come from the thread driving the runtime; an observer that throws is ignored for that event.
 */
template <class O>
concept RuntimeObserver = requires(O& o, moment_kind k, std::string_view n, tier t, double b, double e,
                                   const memory_levels& l) {
  { o.now_us() } -> std::convertible_to<double>;
  o.on_scope_open(k, n, b, e);
  o.on_scope_close(k, n, b, e);
  o.on_copy(t, b, e);
  o.on_step(b, e);
  o.on_memory(l);
};

/** @brief A non-owning reference to any `RuntimeObserver`, or nothing (the default). */
class observer_ref {
 public:
  observer_ref() = default;
  template <RuntimeObserver O>
  observer_ref(O& o) noexcept : obj_(&o), vt_(&vtable_for<O>) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] explicit operator bool() const noexcept { return obj_ != nullptr; }
  [[nodiscard]] double now_us() const noexcept {
    if (obj_ == nullptr) return 0.0;
    try {
      return vt_->now(obj_);
    } catch (...) {  // a clock that throws reads as 0, like an observer that throws loses its event
      return 0.0;
    }
  }
  void scope_open(moment_kind k, std::string_view n, double b, double e) const noexcept {
    call([&] { vt_->open(obj_, k, n, b, e); });
  }
  void scope_close(moment_kind k, std::string_view n, double b, double e) const noexcept {
    call([&] { vt_->close(obj_, k, n, b, e); });
  }
  void copy(tier from, tier to, double b, double e) const noexcept {
    call([&] { vt_->copy(obj_, from, to, b, e); });
  }
  void step(double b, double e) const noexcept {
    call([&] { vt_->step(obj_, b, e); });
  }
  void memory(const memory_levels& l) const noexcept {
    call([&] { vt_->memory(obj_, l); });
  }

 private:
  template <class F>
  void call(F&& f) const noexcept {
    if (obj_ == nullptr) return;
    try {
      f();
    } catch (...) {  // documented: an observer that throws loses that event, nothing else
    }
  }
  struct vtable {
    double (*now)(void*);
    void (*open)(void*, moment_kind, std::string_view, double, double);
    void (*close)(void*, moment_kind, std::string_view, double, double);
    void (*copy)(void*, tier, tier, double, double);
    void (*step)(void*, double, double);
    void (*memory)(void*, const memory_levels&);
  };
  template <class O>
  static constexpr vtable vtable_for{
      [](void* o) { return static_cast<double>(static_cast<O*>(o)->now_us()); },
      [](void* o, moment_kind k, std::string_view n, double b, double e) {
        static_cast<O*>(o)->on_scope_open(k, n, b, e);
      },
      [](void* o, moment_kind k, std::string_view n, double b, double e) {
        static_cast<O*>(o)->on_scope_close(k, n, b, e);
      },
      [](void* o, tier from, tier to, double b, double e) {
        if constexpr (requires(O & x) { x.on_copy(from, to, b, e); }) static_cast<O*>(o)->on_copy(from, to, b, e);
        else if (from != tier::disk && to != tier::disk) static_cast<O*>(o)->on_copy(from, b, e);
      },
      [](void* o, double b, double e) { static_cast<O*>(o)->on_step(b, e); },
      [](void* o, const memory_levels& l) { static_cast<O*>(o)->on_memory(l); },
  };
  void* obj_ = nullptr;
  const vtable* vt_ = nullptr;
};

/** @brief Records what a runtime reports as a Chrome-trace timeline (`timeline()`; write it with
 *  `timeline().write_chrome_trace(path)` and open it in Perfetto): scopes on the compute track,
 *  copies on one track per direction, the step on the optimizer track, memory levels as counters. */
class timeline_observer {
 public:
  timeline_observer() { timeline_.enable(); }
  [[nodiscard]] double now_us() const noexcept { return timeline_.now_us(); }
  void on_scope_open(moment_kind k, std::string_view n, double b, double e) {
    timeline_.span(timeline::track::compute, std::string(moment_kind_name(k)) + " load " + std::string(n), b, e);
  }
  void on_scope_close(moment_kind k, std::string_view, double b, double e) {
    timeline_.span(timeline::track::compute, moment_kind_name(k), b, e);
  }
  void on_copy(tier from, double b, double e) { on_copy(from, from == tier::device ? tier::host : tier::device, b, e); }
  void on_copy(tier from, tier to, double b, double e) {
    const auto t = to == tier::disk       ? timeline::track::to_disk
                   : from == tier::disk   ? timeline::track::from_disk
                   : from == tier::device ? timeline::track::to_host
                                          : timeline::track::to_device;
    timeline_.span(t, "chunk", b, e);
  }
  void on_step(double b, double e) { timeline_.span(timeline::track::optimizer, "optimizer step", b, e); }
  void on_memory(const memory_levels& l) {
    timeline_.counter(
        "device", {{"chunks", static_cast<double>(l.device_chunks)}, {"non_model", static_cast<double>(l.non_model)}});
    timeline_.counter("host", {{"chunks", static_cast<double>(l.host_chunks)}});
    if (l.disk_chunks) timeline_.counter("disk", {{"chunks", static_cast<double>(l.disk_chunks)}});
  }
  [[nodiscard]] timeline& recorded() noexcept { return timeline_; }
  [[nodiscard]] const timeline& recorded() const noexcept { return timeline_; }

 private:
  timeline timeline_;
};

/** @brief Observes nothing (the concept's smallest model; equivalent to an empty observer_ref). */
struct null_observer {
  [[nodiscard]] static constexpr double now_us() noexcept { return 0; }
  void on_scope_open(moment_kind, std::string_view, double, double) noexcept {}
  void on_scope_close(moment_kind, std::string_view, double, double) noexcept {}
  void on_copy(tier, double, double) noexcept {}
  void on_step(double, double) noexcept {}
  void on_memory(const memory_levels&) noexcept {}
};

static_assert(RuntimeObserver<timeline_observer>);
static_assert(RuntimeObserver<null_observer>);

}  // namespace chunkstar
