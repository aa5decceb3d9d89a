#include "tessel/core/toml_value.hpp"

#include <charconv>
#include <system_error>

namespace tessel {

std::optional<toml::table> value_document(const std::string& text) {
  try {
    toml::table table = toml::parse(std::string(kValueDocument) + text);
    if (table.size() == 1 && table.contains("v")) return table;
  } catch (const toml::parse_error&) {
  }
  return std::nullopt;
}

bool outside_double_range(std::string text) {
  std::erase(text, '_');  // digit separators, which from_chars does not take
  if (text.starts_with('+')) text.erase(0, 1);
  double v = 0;
  return std::from_chars(text.data(), text.data() + text.size(), v).ec ==
         std::errc::result_out_of_range;
}

}  // namespace tessel
