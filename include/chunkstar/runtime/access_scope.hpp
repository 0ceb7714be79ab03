// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The RAII handles a runtime gives out: `access_scope` (a layer's forward or backward:
 *         its chunks resident, pinned and in COMPUTE until it closes, with the stream contract for
 *         the memory it hands out) and `untraced_section` (evaluation and sampling, outside the
 *         training trace).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/runtime/param_registry.hpp>

#include <algorithm>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief The chunks a scope of @p kind over @p params needs, in order of first use: each
 *  parameter's param chunk, and in backward its grad chunk. @throws config_error for an unknown
 *  parameter (naming scope @p name). */
[[nodiscard]] inline std::vector<chunk_id> scope_chunks(const chunk_plan& plan, std::span<const param_id> params,
                                                        moment_kind kind, std::string_view name) {
  std::vector<chunk_id> ids;
  for (auto p : params) {
    if (p.value >= plan.slots.size())
      throw config_error("scope '" + std::string(name) + "' names an unknown param_id " + std::to_string(p.value));
    for (auto k : {chunk_kind::param, chunk_kind::grad}) {
      const chunk_id id{k, static_cast<std::uint32_t>(plan.slots[p.value].chunk)};
      if ((k == chunk_kind::param || kind == moment_kind::backward) &&
          std::find(ids.begin(), ids.end(), id) == ids.end())
        ids.push_back(id);
    }
  }
  return ids;
}

/** @brief The names of the scopes open now, innermost last (for messages that name "the open scope"). */
class open_scope_names {
 public:
  void push(std::string_view name) { names_.emplace_back(name); }
  /** @brief Forgets the innermost scope called @p name (scopes may close out of order). */
  void pop(std::string_view name) noexcept {
    for (auto it = names_.rbegin(); it != names_.rend(); ++it)
      if (*it == name) {
        names_.erase(std::next(it).base());
        return;
      }
  }
  [[nodiscard]] std::string_view innermost() const noexcept {
    return names_.empty() ? std::string_view() : names_.back();
  }
  [[nodiscard]] std::size_t size() const noexcept { return names_.size(); }

 private:
  std::vector<std::string> names_;
};

/** @brief An open access scope of runtime @p Runtime: the chunks of its parameters are resident on
 *  the compute tier and pinned, and their tensors in COMPUTE, until it closes.
 *
 *  Stream contract: the spans it hands out are compute-tier memory, valid from the open until the
 *  close. Work the user runs on them asynchronously (on CUDA: kernels on the user's stream) is
 *  handed back with `close(stream)`: later moves of these chunks are then ordered after that work
 *  on the device, never after nothing, and the host does not wait. `close()` (and the destructor)
 *  declare the user's work complete, which it is on host platforms. Move-only. */
template <class Runtime>
class access_scope {
 public:
  using stream_type = typename Runtime::stream_type;

  access_scope(access_scope&& o) noexcept
      : rt_(std::exchange(o.rt_, nullptr)),
        kind_(o.kind_),
        name_(std::move(o.name_)),
        begin_us_(o.begin_us_),
        params_(std::move(o.params_)),
        pins_(std::move(o.pins_)) {}
  access_scope& operator=(access_scope&&) = delete;
  ~access_scope() { close(); }

  /** @brief The parameter's values on the compute tier. @p T must be the runtime's param dtype. */
  template <class T>
  [[nodiscard]] std::span<T> param(param_id p) const {
    return rt_->template scope_span<T>(p, chunk_kind::param, params_);
  }
  /** @brief The parameter's gradient (backward scopes only); kernels accumulate (+=) into it. */
  template <class T>
  [[nodiscard]] std::span<T> grad(param_id p) const {
    if (kind_ != moment_kind::backward)
      throw state_error("grad('" + rt_->spec(p).name + "') in a forward scope: gradients exist in backward scopes");
    return rt_->template scope_span<T>(p, chunk_kind::grad, params_);
  }
  /** @brief Closes the scope: the user's work on its memory is complete. */
  void close() noexcept {
    if (rt_) std::exchange(rt_, nullptr)->scope_closed(kind_, name_, begin_us_, params_, pins_);
  }
  /** @brief Closes the scope with the user's work on its memory still running on @p stream:
   *  later moves of its chunks wait for that work. */
  void close(const stream_type& stream) {
    if (!rt_) return;
    rt_->order_after_user(pins_.ids(), stream);
    close();
  }

 private:
  friend Runtime;
  using pins_type = typename Runtime::store_type::pin_set;
  access_scope(Runtime* rt, moment_kind k, std::string_view name, double begin_us, std::vector<param_id> p,
               pins_type pins)
      : rt_(rt), kind_(k), name_(name), begin_us_(begin_us), params_(std::move(p)), pins_(std::move(pins)) {}
  Runtime* rt_;
  moment_kind kind_;
  std::string name_;
  double begin_us_;
  std::vector<param_id> params_;
  pins_type pins_;
};

/** @brief While alive, the runtime's scopes are not traced (evaluation passes, sampling): decisions
 *  fall back to trace-free behaviour (current-use budgets, LRU order, no prefetch), so the training
 *  trace stays valid. On destruction the parameters used return to HOLD. Not nestable; no scope may
 *  outlive it. Move-only. */
template <class Runtime>
class untraced_section {
 public:
  untraced_section(untraced_section&& o) noexcept : rt_(std::exchange(o.rt_, nullptr)) {}
  untraced_section& operator=(untraced_section&&) = delete;
  ~untraced_section() {
    if (rt_) rt_->end_untraced();
  }

 private:
  friend Runtime;
  explicit untraced_section(Runtime* rt) : rt_(rt) {}
  Runtime* rt_;
};

}  // namespace chunkstar
