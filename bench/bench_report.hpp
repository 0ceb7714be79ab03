// SPDX-License-Identifier: Apache-2.0
// What every benchmark reports with: flat JSON records and a gnuplot PNG.
#pragma once

#include <chunkstar/core/error.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar::bench {

/** @brief Minimal JSON writing: records are flat objects of numbers, booleans and strings. */
class json_record {
 public:
  json_record& str(const std::string& k, const std::string& v) {
    std::string e;
    for (char ch : v) {
      if (ch == '"' || ch == '\\') e += '\\';
      if (ch == '\n') {
        e += "\\n";
        continue;
      }
      e += ch;
    }
    return raw(k, "\"" + e + "\"");
  }
  json_record& num(const std::string& k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    return raw(k, buf);
  }
  json_record& boolean(const std::string& k, bool v) { return raw(k, v ? "true" : "false"); }
  [[nodiscard]] const std::string& text() const noexcept { return body_; }
  [[nodiscard]] std::string object() const { return "{" + body_ + "}"; }

 private:
  json_record& raw(const std::string& k, const std::string& v) {
    body_ += (body_.empty() ? "\"" : ", \"") + k + "\": " + v;
    return *this;
  }
  std::string body_;
};

inline void write_json(const std::string& path, const std::vector<json_record>& records) {
  std::ofstream f(path);
  if (!f) throw config_error("cannot write --json '" + path + "': check that its directory exists");
  f << "[\n";
  for (std::size_t i = 0; i < records.size(); ++i)
    f << "  " << records[i].object() << (i + 1 < records.size() ? ",\n" : "\n");
  f << "]\n";
  if (!f) throw config_error("failed writing --json '" + path + "': check free disk space");
  std::printf("json: %s\n", path.c_str());
}

/** @brief Runs gnuplot on @p script after writing @p data_files (name -> contents) into a temporary
 *  directory; `@DIR@` in the script is replaced by that directory. Returns 0 on success. */
inline int run_gnuplot(const std::string& program, const std::string& png, std::string script,
                       const std::vector<std::pair<std::string, std::string>>& data_files,
                       const std::string& size = "1400,900") {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr, "%s: --plot needs gnuplot on PATH (apt-get install gnuplot-nox); no plot written\n",
                 program.c_str());
    return 1;
  }
  const auto dir = std::filesystem::temp_directory_path() / (program + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const auto& [name, text] : data_files) std::ofstream(dir / name) << text;
  for (std::size_t at; (at = script.find("@DIR@")) != std::string::npos;) script.replace(at, 5, dir.string());
  std::ofstream(dir / "plot.gp") << "set terminal pngcairo size " << size << " font ',10'\nset output '" << png << "'\n"
                                 << script;
  const int rc = std::system(("gnuplot '" + (dir / "plot.gp").string() + "'").c_str());
  std::filesystem::remove_all(dir);
  if (rc != 0) {
    std::fprintf(stderr, "%s: gnuplot failed (exit %d); no plot written\n", program.c_str(), rc);
    return 1;
  }
  std::printf("plot: %s\n", png.c_str());
  return 0;
}

}  // namespace chunkstar::bench
