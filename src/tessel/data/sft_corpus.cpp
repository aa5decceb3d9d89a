#include "tessel/data/sft_corpus.hpp"

#include <nlohmann/json.hpp>
#include <optional>

#include "tessel/core/error.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/data/json_lines.hpp"

namespace tessel::data {

namespace {

const char* role_label(const std::string& role) {
  if (role == "system") return "System: ";
  if (role == "user") return "User: ";
  if (role == "assistant") return "Assistant: ";
  return nullptr;
}

void append(SftSample& s, std::string_view text, bool trained) {
  s.text.append(text);
  s.trained.insert(s.trained.end(), text.size(), trained ? 1 : 0);
}

// A JSON value that must be a string: its text, or an InputError naming where it is.
std::string string_field(const nlohmann::json& object, const char* key, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) input_error(where, ": no \"", key, "\"");
  if (!it->is_string()) input_error(where, ": \"", key, "\" is not a string");
  return it->get<std::string>();
}

std::vector<ChatMessage> conversation_of(const nlohmann::json& line, const std::string& where) {
  if (!line.is_object()) input_error(where, ": not a JSON object");
  if (line.contains("messages") && (line.contains("prompt") || line.contains("response")))
    input_error(where, ": both \"messages\" and \"prompt\"/\"response\"; use one form per line");
  if (line.contains("messages")) {
    const auto& list = line["messages"];
    if (!list.is_array()) input_error(where, ": \"messages\" is not an array");
    std::vector<ChatMessage> messages;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string at = where + ": messages[" + std::to_string(i) + "]";
      if (!list[i].is_object()) input_error(at, ": not a JSON object");
      messages.push_back({string_field(list[i], "role", at), string_field(list[i], "content", at)});
    }
    return messages;
  }
  if (line.contains("prompt") || line.contains("response"))
    return {{"user", string_field(line, "prompt", where)},
            {"assistant", string_field(line, "response", where)}};
  input_error(where, ": neither \"messages\" nor \"prompt\" and \"response\"");
}

// "Genesis 1" -> ("Genesis", "1"); the book name may hold spaces ("Song of Solomon 3").
std::pair<std::string_view, std::string_view> split_heading(std::string_view heading) {
  const size_t space = heading.rfind(' ');
  TESSEL_CHECK(space != std::string_view::npos, "bible chapter heading \"", heading,
               "\" without a chapter number");
  return {heading.substr(0, space), heading.substr(space + 1)};
}

}  // namespace

SftSample render_conversation(std::span<const ChatMessage> messages, const std::string& where) {
  SftSample s;
  bool replied = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const char* label = role_label(m.role);
    if (!label)
      input_error(where, ": messages[", i, "]: role ", json_quote(m.role),
                  " is not system, user or assistant");  // escaped: one line, whole
    const bool reply = m.role == "assistant";
    append(s, label, false);
    append(s, m.content, reply);
    append(s, "\n", reply);
    replied = replied || (reply && !m.content.empty());
  }
  if (!replied)
    input_error(where,
                ": no assistant message with content; an SFT sample needs a reply to "
                "train on");
  return s;
}

std::vector<SftSample> parse_chat_jsonl(std::string_view text, const std::string& source) {
  std::vector<SftSample> samples;
  for_each_json_line(text, source, [&](const nlohmann::json& json, const std::string& where) {
    samples.push_back(render_conversation(conversation_of(json, where), where));
  });
  if (samples.empty()) input_error(source, ": no conversations (the file is empty or blank)");
  return samples;
}

std::vector<SftSample> bible_quote_samples(const std::vector<std::string>& chapters) {
  std::vector<SftSample> samples;
  for (const std::string& chapter : chapters) {
    std::optional<std::pair<std::string_view, std::string_view>> heading;  // book, chapter
    for_each_line(chapter, [&](std::string_view verse) {
      if (!heading) {  // the chapter's first line
        heading = split_heading(verse);
        return;
      }
      const auto& [book, number] = *heading;
      const size_t space = verse.find(' ');
      TESSEL_CHECK(space != std::string_view::npos && space > 0, "bible verse \"", verse,
                   "\" without a verse number");
      const ChatMessage messages[2] = {
          {"user", detail::concat("Quote ", book, " ", number, ":", verse.substr(0, space), ".")},
          {"assistant", std::string(verse.substr(space + 1))}};
      samples.push_back(render_conversation(messages, std::string(verse)));
    });
  }
  return samples;
}

bool is_sft_corpus(const std::string& name) {
  return name == "bible-quotes" || (name.starts_with("chat:") && name.size() > 5);
}

std::vector<SftSample> load_sft_corpus(const std::string& name) {
  if (name == "bible-quotes") return bible_quote_samples(load_corpus("bible"));
  if (is_sft_corpus(name)) {
    const std::string path = name.substr(5);
    return parse_chat_jsonl(read_corpus_file(path, "chat"), path);
  }
  input_error("\"", name, "\" is not an SFT corpus (expected bible-quotes or chat:PATH)");
}

}  // namespace tessel::data
