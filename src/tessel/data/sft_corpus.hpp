#pragma once
// Supervised fine-tuning (SFT) corpora: conversations rendered into text samples whose loss
// covers only the assistant's replies.
//
// Rendering (no special tokens, whatever the tokenizer). Message by message, a conversation becomes
//   "System: " content "\n"    "User: " content "\n"    "Assistant: " content "\n"
// and only the bytes of an assistant's `content "\n"` are trained on. The rest, the role labels
// included, is context the model reads but is never asked to predict; in particular the
// generation prompt "Assistant: " carries no loss (a known bug class is training on it). The
// reply's closing "\n" is trained, so the model learns where a reply ends. To ask a fine-tuned
// model, prompt it with the same rendering up to and including "Assistant: ".
//
// Corpora (`tessel prepare --corpus NAME`):
//  - "bible-quotes": one conversation per verse of the King James Bible (corpus "bible"):
//    user "Quote Genesis 1:3." and assistant the verse's text (31102 samples).
//  - "chat:PATH": a JSON Lines file, one conversation per non-blank line, either
//    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]} or
//    {"prompt": "...", "response": "..."} (a user message and the assistant's reply).
//    Every conversation needs at least one assistant message with non-empty content.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// One rendered conversation: text [n bytes] and trained [n], 1 where the byte is a target the
// loss counts (the bytes of the assistant replies).
struct SftSample {
  std::string text;
  std::vector<uint8_t> trained;
};

// InputError naming `where` for an unknown role or a conversation without a non-empty
// assistant message.
SftSample render_conversation(std::span<const ChatMessage> messages, const std::string& where);

// A JSON Lines text -> one sample per non-blank line; errors name `source` and the line.
std::vector<SftSample> parse_chat_jsonl(std::string_view text, const std::string& source);

// The chapters of corpus "bible" (corpus.hpp: heading line, then "N text" per verse) -> one
// quote conversation per verse.
std::vector<SftSample> bible_quote_samples(const std::vector<std::string>& chapters);

// Whether `name` is an SFT corpus ("bible-quotes" or "chat:PATH"), and its samples.
bool is_sft_corpus(const std::string& name);
std::vector<SftSample> load_sft_corpus(const std::string& name);

}  // namespace tessel::data
