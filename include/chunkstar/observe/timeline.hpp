// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A memory and transfer timeline, exported as Chrome trace JSON (loads in Perfetto and
 *         chrome://tracing): scopes and transfers as spans, per-space use as counters.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace chunkstar {

/** @brief Collects events while enabled; cheap no-ops while disabled. Thread-safe. */
class timeline {
 public:
  /** @brief Tracks ("threads" in the viewer) spans are drawn on. */
  enum class track : std::uint8_t {
    compute = 1,
    to_device = 2,
    to_host = 3,
    optimizer = 4,
    to_disk = 5,
    from_disk = 6
  };

  using clock = std::chrono::steady_clock;

  void enable(bool on = true) noexcept { enabled_ = on; }
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }

  /** @brief Microseconds since the timeline was created. */
  [[nodiscard]] double now_us() const noexcept {
    return std::chrono::duration<double, std::micro>(clock::now() - origin_).count();
  }

  /** @brief A completed span [begin_us, end_us) on @p t. */
  void span(track t, std::string_view name, double begin_us, double end_us) {
    if (!enabled_) return;
    std::lock_guard lock(mutex_);
    events_.push_back({'X', t, std::string(name), begin_us, end_us - begin_us, {}});
  }

  /** @brief A counter sample: named series with values (bytes), drawn as a stacked area. */
  void counter(std::string_view name, std::vector<std::pair<std::string, double>> values) {
    if (!enabled_) return;
    std::lock_guard lock(mutex_);
    events_.push_back({'C', track::compute, std::string(name), now_us(), 0, std::move(values)});
  }

  [[nodiscard]] std::size_t size() const {
    std::lock_guard lock(mutex_);
    return events_.size();
  }

  /** @brief Writes the Chrome trace JSON object format to @p path (atomically: a temporary renamed
   *  over it). @throws io_error naming the file. */
  void write_chrome_trace(const std::string& path) const {
    // Written beside the target and renamed over it: a failure leaves any earlier file whole. The
    // temporary is created exclusively ("x": never an existing file, never through a link).
    static std::atomic<unsigned> serial{0};
    std::string tmp;
    std::FILE* out = nullptr;
    for (int attempt = 0; out == nullptr; ++attempt) {
      tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial++);
      out = std::fopen(tmp.c_str(), "wbx");
      if (out == nullptr && (errno != EEXIST || attempt > 1000))
        throw io_error("cannot create timeline file '" + tmp + "': " + std::strerror(errno) +
                       "; check the directory exists and is writable");
    }
    const std::string json = to_chrome_trace();
    const bool written = std::fwrite(json.data(), 1, json.size(), out) == json.size();
    if (std::fclose(out) != 0 || !written) {
      std::remove(tmp.c_str());
      throw io_error("failed writing timeline file '" + tmp + "': check free disk space");
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      std::remove(tmp.c_str());
      throw io_error("cannot rename '" + tmp + "' to timeline file '" + path + "': " + std::strerror(err));
    }
  }

  /** @brief The Chrome trace JSON text. */
  [[nodiscard]] std::string to_chrome_trace() const {
    std::lock_guard lock(mutex_);
    std::string s = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    static constexpr const char* track_names[] = {"",          "compute",      "copy to device", "copy to host",
                                                  "optimizer", "copy to disk", "copy from disk"};
    for (int t = 1; t <= 6; ++t) {
      s += "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":" + std::to_string(t) + ",\"args\":{\"name\":\"" +
           track_names[t] + "\"}},\n";
    }
    char num[64];
    for (std::size_t i = 0; i < events_.size(); ++i) {
      const auto& e = events_[i];
      s += "{\"ph\":\"";
      s += e.phase;
      s += "\",\"name\":\"" + escape(e.name) + "\",\"pid\":1,\"tid\":" + std::to_string(static_cast<int>(e.where));
      std::snprintf(num, sizeof num, ",\"ts\":%.3f", e.ts_us);
      s += num;
      if (e.phase == 'X') {
        std::snprintf(num, sizeof num, ",\"dur\":%.3f", e.dur_us);
        s += num;
      } else {
        s += ",\"args\":{";
        for (std::size_t k = 0; k < e.values.size(); ++k) {
          std::snprintf(num, sizeof num, "%.0f", e.values[k].second);
          s += (k ? ",\"" : "\"") + escape(e.values[k].first) + "\":" + num;
        }
        s += "}";
      }
      s += i + 1 < events_.size() ? "},\n" : "}\n";
    }
    s += "]}\n";
    return s;
  }

 private:
  struct event {
    char phase;
    track where;
    std::string name;
    double ts_us;
    double dur_us;
    std::vector<std::pair<std::string, double>> values;
  };

  static std::string escape(std::string_view in) {
    std::string out;
    for (char c : in) {
      if (c == '"' || c == '\\') out += '\\';
      if (static_cast<unsigned char>(c) < 0x20) continue;  // names are ours; drop control characters
      out += c;
    }
    return out;
  }

  clock::time_point origin_ = clock::now();
  bool enabled_ = false;
  mutable std::mutex mutex_;
  std::vector<event> events_;
};

}  // namespace chunkstar
