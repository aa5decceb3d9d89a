#pragma once
// JSON input: JSON Lines (one value per line), shared by the corpora that read it: "jsonl:PATH"
// text (corpus.hpp) and "chat:PATH" conversations (sft_corpus.hpp); and single JSON files
// (a BPE vocab.json).
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace tessel::data {

// `s` as a JSON string literal, escaped, so that a message quoting it stays one line and whole
// (a NUL or newline in it would cut or split it); bytes that are not UTF-8 become U+FFFD. A
// string longer than `max_bytes` is cut there (at a character) and followed by
// "... (N bytes)".
std::string json_quote(std::string_view s, size_t max_bytes = std::string_view::npos);

// One JSON value; InputError naming `where` for text that is not valid JSON or an object
// with a key twice (nlohmann would keep the last; more likely a mistake than meant).
nlohmann::json parse_json(std::string_view text, const std::string& where);

// Calls f(value, where) for each non-blank line of `text` in order, `where` naming it as
// "<source>:<line number>" for error messages. InputError naming the line for text that is not
// valid JSON, a NUL byte (nlohmann's parser would ignore the rest of the line) or a key that
// appears twice in one object (nlohmann would keep the last; more likely a mistake than meant).
void for_each_json_line(std::string_view text, const std::string& source,
                        const std::function<void(const nlohmann::json&, const std::string&)>& f);

}  // namespace tessel::data
