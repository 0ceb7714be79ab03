// SPDX-License-Identifier: Apache-2.0
// Run-time ISA dispatch: detection agrees with the CPU, force_cpu_isa / scoped_cpu_isa / the
// CHUNKSTAR_CPU_ISA variable choose the path, and the choice is reported. This file is compiled
// with the default flags (no -m options): every path is in the binary anyway. optim_isa.cmake also
// runs it with CHUNKSTAR_CPU_ISA set (test cpu_isa_env_*), and the test reads the variable to know
// what to expect.
#include <chunkstar/core/cpu_isa.hpp>

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

using namespace chunkstar;

namespace cpu_isa_test {

TEST_CASE("detection agrees with the CPU, and the widest supported path is detected") {
  MESSAGE("cpu_isa_report(): " << cpu_isa_report());
  CHECK(cpu_isa_supported(cpu_isa::portable));
  CHECK(cpu_isa_supported(detected_cpu_isa()));
  if (detected_cpu_isa() == cpu_isa::avx512) CHECK(cpu_isa_supported(cpu_isa::avx2));
  if (cpu_isa_supported(cpu_isa::avx512)) CHECK(detected_cpu_isa() == cpu_isa::avx512);
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
  CHECK(cpu_isa_available_v<cpu_isa::avx2>);
  CHECK(cpu_isa_available_v<cpu_isa::avx512>);
  __builtin_cpu_init();  // the compiler's own view (it also checks the OS's register state)
  CHECK(cpu_isa_supported(cpu_isa::avx2) == (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")));
  CHECK(cpu_isa_supported(cpu_isa::avx512) == (cpu_isa_supported(cpu_isa::avx2) && __builtin_cpu_supports("avx512f")));
#endif
  CHECK(parse_cpu_isa("avx2") == cpu_isa::avx2);
  CHECK(parse_cpu_isa("avx512") == cpu_isa::avx512);
  CHECK(parse_cpu_isa("portable") == cpu_isa::portable);
  CHECK_FALSE(parse_cpu_isa("sse4").has_value());
}

TEST_CASE("CHUNKSTAR_CPU_ISA picks the path when the CPU supports it, and is reported either way") {
  const char* env = std::getenv("CHUNKSTAR_CPU_ISA");
  const std::string report = cpu_isa_report();
  if (!env) {
    CHECK(active_cpu_isa() == detected_cpu_isa());
    CHECK(report == std::string(cpu_isa_name(detected_cpu_isa())) + " (detected)");
    return;
  }
  const auto wanted = parse_cpu_isa(env);
  if (wanted && cpu_isa_supported(*wanted)) {
    CHECK(active_cpu_isa() == *wanted);
    CHECK(report.find("CHUNKSTAR_CPU_ISA=" + std::string(env)) != std::string::npos);
  } else {
    CHECK(active_cpu_isa() == detected_cpu_isa());
    CHECK(report.find("ignored") != std::string::npos);
  }
}

TEST_CASE("force_cpu_isa and scoped_cpu_isa choose the path for every thread; unsupported ones throw") {
  const cpu_isa before = active_cpu_isa();
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512}) {
    CAPTURE(cpu_isa_name(isa));
    if (!cpu_isa_supported(isa)) {
      CHECK_THROWS_AS(force_cpu_isa(isa), config_error);
      CHECK_THROWS_AS(scoped_cpu_isa{isa}, config_error);
      CHECK(active_cpu_isa() == before);
      continue;
    }
    {
      const scoped_cpu_isa forced(isa);
      CHECK(active_cpu_isa() == isa);
      CHECK(cpu_isa_report().find("forced") != std::string::npos);
      {
        const scoped_cpu_isa inner(cpu_isa::portable);
        CHECK(active_cpu_isa() == cpu_isa::portable);
      }
      CHECK(active_cpu_isa() == isa);  // nested scopes restore the outer choice
    }
    CHECK(active_cpu_isa() == before);
    force_cpu_isa(isa);
    CHECK(active_cpu_isa() == isa);
    reset_cpu_isa();
    CHECK(active_cpu_isa() == before);
  }
}

TEST_CASE("with_cpu_isa calls the kernel instantiated for the ISA asked for") {
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512}) {
    const cpu_isa got = with_cpu_isa(isa, [](auto i) { return i(); });
    CHECK(got == (cpu_isa_available_v<cpu_isa::avx2> ? isa : cpu_isa::portable));
  }
}

}  // namespace cpu_isa_test
