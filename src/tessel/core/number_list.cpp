#include "tessel/core/number_list.hpp"

#include <cmath>

#include "tessel/core/error.hpp"

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

// Each item of `text` through `parse(item, used)`, which must consume all of it.
template <class T, class Parse>
std::vector<T> parse_list(const std::string& key, const std::string& text, T min, bool min_excluded,
                          const char* what, Parse parse) {
  std::vector<T> out;
  for (const std::string& item : split_list(key, text)) {
    size_t used = 0;
    T value{};
    try {
      // A sign on a value that cannot be negative ("-0", "+3") is no such value's spelling.
      const size_t at = item.find_first_not_of(" \t\n\v\f\r");  // stoll skips these
      const char first = at == std::string::npos ? '\0' : item[at];
      if (!(min >= 0 && (first == '-' || first == '+'))) value = parse(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || !(min_excluded ? value > min : value >= min))
      input_error("config key '", key, "' = \"", text, "\": '", item, "' is not ", what,
                  min_excluded ? " > " : " >= ", min, " (expected comma-separated values)");
    out.push_back(value);
  }
  return out;
}

}  // namespace

std::vector<int64_t> parse_int_list(const std::string& key, const std::string& text, int64_t min) {
  return parse_list<int64_t>(
      key, text, min, false, "an integer",
      [](const std::string& s, size_t* used) { return std::stoll(s, used); });
}

std::vector<double> parse_real_list(const std::string& key, const std::string& text, double min,
                                    bool min_excluded) {
  return parse_list<double>(key, text, min, min_excluded, "a number",
                            [](const std::string& s, size_t* used) {
                              const double v = std::stod(s, used);
                              if (!std::isfinite(v)) *used = 0;
                              return v;
                            });
}

}  // namespace tessel
