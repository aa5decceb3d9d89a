#include "tessel/core/number_list.hpp"

#include <cmath>
#include <optional>
#include <type_traits>

#include "tessel/core/error.hpp"
#include "tessel/core/toml_value.hpp"

namespace tessel {

std::vector<std::string> split_list(const std::string& key, const std::string& text) {
  std::vector<std::string> items;
  if (text.find_first_not_of(' ') == std::string::npos) return items;
  for (size_t start = 0; start <= text.size();) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    start = end + 1;
    const size_t begin = item.find_first_not_of(' ');
    if (begin == std::string::npos)
      input_error("config key '", key, "' = \"", text,
                  "\": '' is an empty item (expected comma-separated values)");
    items.push_back(item.substr(begin, item.find_last_not_of(' ') + 1 - begin));
  }
  return items;
}

namespace {

// `item` as a config file reads a number (toml_value.hpp): an integer, or for a real list a
// float too, finite and inside a double's range; nullopt for any other text (C's .5, 1., 007
// or 0x1p3, inf, nan, or a '#', which TOML would take for a comment).
template <class T>
std::optional<T> toml_number(const std::string& item) {
  if (item.find('#') != std::string::npos) return std::nullopt;
  const std::optional<toml::table> document = value_document(item);
  if (!document) return std::nullopt;
  const toml::node& node = *document->get("v");
  if (const auto* i = node.as_integer()) return T(i->get());
  const auto* f = node.as_floating_point();
  if (!std::is_floating_point_v<T> || !f || outside_double_range(item) || !std::isfinite(f->get()))
    return std::nullopt;
  return T(f->get());
}

// Each item of `text` as toml_number reads it; `what` names such a number, `spelling` shows how
// one is written.
template <class T>
std::vector<T> parse_list(const std::string& key, const std::string& text, T min, bool min_excluded,
                          const char* what, const char* spelling) {
  std::vector<T> out;
  for (const std::string& item : split_list(key, text)) {
    // A sign on a value that cannot be negative ("-0", "+3") is no such value's spelling.
    const size_t at = item.find_first_not_of(" \t");  // the blanks TOML skips before a value
    const char first = at == std::string::npos ? '\0' : item[at];
    std::optional<T> value;
    if (!(min >= 0 && (first == '-' || first == '+'))) value = toml_number<T>(item);
    if (!value || !(min_excluded ? *value > min : *value >= min))
      input_error("config key '", key, "' = \"", text, "\": '", item, "' is not ", what,
                  min_excluded ? " > " : " >= ", min, " (expected comma-separated values, ",
                  spelling, ")");
    out.push_back(*value);
  }
  return out;
}

}  // namespace

std::vector<int64_t> parse_int_list(const std::string& key, const std::string& text, int64_t min) {
  return parse_list<int64_t>(key, text, min, false, "an integer",
                             "integers as TOML writes them: 1000, 1_000, 0x10");
}

std::vector<double> parse_real_list(const std::string& key, const std::string& text, double min,
                                    bool min_excluded) {
  return parse_list<double>(key, text, min, min_excluded, "a number",
                            "numbers as TOML writes them: 0.5, 1e-3, 1_000");
}

}  // namespace tessel
