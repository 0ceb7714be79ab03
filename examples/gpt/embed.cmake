# SPDX-License-Identifier: Apache-2.0
# cmake -DIN=file -DOUT=file.cpp -DNAME=symbol -P embed.cmake: writes a C++ source holding IN's bytes.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR size "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" bytes "${bytes}")
file(WRITE "${OUT}" "// Generated from ${IN} by embed.cmake; do not edit.\n#include <cstddef>\n"
     "extern const unsigned char ${NAME}[] = {\n${bytes}0x00};\n"
     "extern const std::size_t ${NAME}_size = ${size};\n")
