#pragma once
// One value read on its own by a config file's TOML rules: what `--set key=value` and the
// numbers of a config's comma-separated lists (number_list.hpp) are parsed as, so that a number
// is spelled alike everywhere in a config (1_000, 0x10, 5e-324; not C's .5, 1., 007 or 0x1p3).
#include <toml++/toml.h>

#include <optional>
#include <string>
#include <string_view>

namespace tessel {

// `text` as the value of a one-key TOML document, kValueDocument + text ("v = text"); nullopt
// unless it parses as exactly one value, under the key "v".
inline constexpr std::string_view kValueDocument = "v = ";
std::optional<toml::table> value_document(const std::string& text);

// Whether a TOML float literal lies outside a double's range: beyond the largest (toml++
// refuses 1e400 itself) or a nonzero value below the smallest subnormal, which toml++ reads as
// 0 (1e-400). Subnormals (5e-324) are in range.
bool outside_double_range(std::string text);

}  // namespace tessel
