// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `function_ref`: a non-owning reference to a callable (C++26's `std::function_ref`, cut
 *         down). The runtime takes the user's per-chunk callbacks through it, so its own code is
 *         compiled once per assembly instead of once per lambda (see docs/design.md, "Compiling
 *         the runtime once").
 */
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace chunkstar {

template <class Signature>
class function_ref;

/** @brief Refers to a callable invocable as `R(Args...)`; the callable must outlive the reference
 *  (pass it down a call, never store it). Copyable, two pointers, no allocation. */
template <class R, class... Args>
class function_ref<R(Args...)> {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, function_ref> && std::is_invocable_r_v<R, F&, Args...>)
      function_ref(F&& f)
  noexcept  // NOLINT(google-explicit-constructor): converts like std::function_ref
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_(&invoke<std::remove_reference_t<F>>) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  template <class F>
  static R invoke(void* object, Args... args) {
    if constexpr (std::is_void_v<R>) std::invoke(*static_cast<F*>(object), std::forward<Args>(args)...);
    else return std::invoke(*static_cast<F*>(object), std::forward<Args>(args)...);
  }

  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace chunkstar
