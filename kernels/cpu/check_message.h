// Error messages of the kernels' argument checks, built without iostreams.
//
// TORCH_CHECK formats several arguments through std::ostringstream, whose templates
// (std::ostream::_M_insert<long> and the like) a compiler may instantiate inside this
// library; a g++ 13 build against a torch built elsewhere crashed in its own copy while
// formatting an integer, killing the process instead of raising. Handed one C string,
// TORCH_CHECK formats nothing, so PDSERVE_CHECK and PDSERVE_CHECK_VALUE build that string
// here with std::to_string and appends. The message is built only when the check fails.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace pdserve {

inline void append_to_message(std::string& out, const char* text) { out += text; }
inline void append_to_message(std::string& out, const std::string& text) { out += text; }
inline void append_to_message(std::string& out, c10::ScalarType dtype) { out += c10::toString(dtype); }

inline void append_to_message(std::string& out, c10::IntArrayRef sizes) {
  out += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  out += ']';
}

template <typename T>
  requires(std::is_arithmetic_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>)
inline void append_to_message(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Args>
std::string check_message(const Args&... parts) {
  std::string out;
  (append_to_message(out, parts), ...);
  return out;
}

}  // namespace pdserve

#define PDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, ::pdserve::check_message(__VA_ARGS__).c_str())
#define PDSERVE_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::pdserve::check_message(__VA_ARGS__).c_str())
