#include "tessel/data/json_lines.hpp"

#include <set>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/data/corpus.hpp"

namespace tessel::data {

std::string json_quote(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes)
    return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  size_t cut = max_bytes;  // back to the start of a character: no U+FFFD for a cut one
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return detail::concat(json_quote(s.substr(0, cut)), "... (", s.size(), " bytes)");
}

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  std::vector<std::set<std::string>> keys;  // of each open object
  std::string duplicate;
  auto track_keys = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end) keys.pop_back();
    if (event == Event::key && !keys.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text, track_keys);
  } catch (const nlohmann::json::exception& e) {  // parse errors, number overflows
    input_error(where, ": not valid JSON (", e.what(), ")");
  }
  if (!duplicate.empty())
    input_error(where, ": key ", json_quote(duplicate), " appears twice in one object");
  return json;
}

void for_each_json_line(std::string_view text, const std::string& source,
                        const std::function<void(const nlohmann::json&, const std::string&)>& f) {
  size_t line_no = 0;
  for_each_line(text, [&](std::string_view line) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
    const std::string where = source + ":" + std::to_string(line_no);
    if (line.find('\0') != std::string_view::npos) input_error(where, ": holds a NUL byte");
    f(parse_json(line, where), where);
  });
}

}  // namespace tessel::data
