#pragma once
// JSON Lines input (one JSON value per line), shared by the corpora that read it: "jsonl:PATH"
// text (corpus.hpp) and "chat:PATH" conversations (sft_corpus.hpp).
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace tessel::data {

// Calls f(value, where) for each non-blank line of `text` in order, `where` naming it as
// "<source>:<line number>" for error messages. InputError naming the line for text that is not
// valid JSON, a NUL byte (nlohmann's parser would ignore the rest of the line) or a key that
// appears twice in one object (nlohmann would keep the last; more likely a mistake than meant).
void for_each_json_line(std::string_view text, const std::string& source,
                        const std::function<void(const nlohmann::json&, const std::string&)>& f);

}  // namespace tessel::data
