#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>

#include "tessel/data/corpus.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::bible_documents;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

namespace {

std::vector<std::string> lines_of(const std::string& doc) {
  std::vector<std::string> lines;
  size_t begin = 0;
  for (size_t end; (end = doc.find('\n', begin)) != std::string::npos; begin = end + 1)
    lines.push_back(doc.substr(begin, end - begin));
  EXPECT_EQ(begin, doc.size()) << "document does not end in a newline";
  return lines;
}

}  // namespace

TEST(Corpus, BibleHasOneDocumentPerChapter) {
  const auto& docs = bible_documents();
  ASSERT_EQ(docs.size(), 1189u);  // chapters of the King James Bible
  EXPECT_TRUE(docs[0].starts_with(
      "Genesis 1\n"
      "1 In the beginning God created the heaven and the earth.\n"
      "2 And the earth was without form, and void; and darkness was upon the face of the deep. "
      "And the Spirit of God moved upon the face of the waters.\n"))
      << docs[0].substr(0, 300);
  EXPECT_TRUE(docs.back().starts_with("Revelation 22\n1 And he shewed me a pure river"));
  EXPECT_TRUE(
      docs.back().ends_with("\n21 The grace of our Lord Jesus Christ be with you all. Amen.\n"));

  // Every chapter: a heading "Book N", then verses numbered 1, 2, ... with no wrapped lines.
  size_t psalm119_verses = 0;
  for (const auto& doc : docs) {
    const auto lines = lines_of(doc);
    ASSERT_GE(lines.size(), 2u) << doc;
    const std::string& heading = lines[0];
    ASSERT_TRUE(std::isdigit(static_cast<unsigned char>(heading.back()))) << heading;
    for (size_t v = 1; v < lines.size(); ++v)
      ASSERT_TRUE(lines[v].starts_with(std::to_string(v) + " ")) << heading << ": " << lines[v];
    if (heading == "Psalms 119") psalm119_verses = lines.size() - 1;
  }
  EXPECT_EQ(psalm119_verses, 176u);
}

TEST(Corpus, ParseBibleJoinsWrappedVerses) {
  const std::string text =
      "\nJude 1\n\n  1 Jude, the servant\nof Jesus Christ.\n  2 Mercy unto you.\n"
      "\nRuth 2\n\n  1 And Naomi had\n";
  const auto docs = parse_bible(text, "test");
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0], "Jude 1\n1 Jude, the servant of Jesus Christ.\n2 Mercy unto you.\n");
  EXPECT_EQ(docs[1], "Ruth 2\n1 And Naomi had\n");
  expect_input_error([] { parse_bible("  1 stray verse\n", "src"); }, {"src", "line 1"});
}

TEST(Corpus, Fortunes) {
  const auto docs = load_corpus("fortunes");
  EXPECT_GT(docs.size(), 10000u);  // the package holds about 15000 fortunes
  for (const auto& doc : docs) {
    ASSERT_FALSE(doc.empty());
    ASSERT_EQ(doc.back(), '\n');
    ASSERT_NE(doc.front(), '\n') << doc;
    ASSERT_EQ(doc.find("\n%\n"), std::string::npos) << doc;
    ASSERT_FALSE(doc.starts_with("%\n")) << doc;
  }
}

TEST(Corpus, ParseFortunes) {
  EXPECT_EQ(parse_fortunes("a\n%\n\nb\n\n  c\n\n%\n%\nd"),
            (std::vector<std::string>{"a\n", "b\n\n  c\n", "d\n"}));
}

TEST(Corpus, FileParagraphs) {
  TempDir dir;
  const std::string path = dir.file("text.txt");
  std::ofstream(path) << "\n\nFirst line\nsecond line\n \t\nÜber café\r\n\n\n\nlast";
  EXPECT_EQ(load_corpus("file:" + path),
            (std::vector<std::string>{"First line\nsecond line\n", "Über café\n", "last\n"}));
  // A leading byte-order mark is not text; one further in is (a zero-width no-break space).
  std::ofstream(path) << "\xEF\xBB\xBF"
                         "First\n\nsecond \xEF\xBB\xBF\n";
  EXPECT_EQ(load_corpus("file:" + path),
            (std::vector<std::string>{"First\n", "second \xEF\xBB\xBF\n"}));
}

// JSON Lines: each line's "text" exactly as given (blank lines inside, no final newline,
// escapes decoded), other keys ignored, blank lines and empty texts skipped.
TEST(Corpus, JsonLinesTexts) {
  TempDir dir;
  const std::string path = dir.file("docs.jsonl");
  std::ofstream(path) << "\xEF\xBB\xBF{\"text\": \"First.\\n\\nAfter a blank line.\", \"id\": 1}\n"
                         "\n"
                         "  \n"
                         "{\"text\": \"\", \"id\": 2}\r\n"
                         "{\"meta\": {\"text\": 5}, \"text\": \"caf\\u00e9 \\\"quoted\\\"\"}";
  EXPECT_EQ(load_corpus("jsonl:" + path),
            (std::vector<std::string>{"First.\n\nAfter a blank line.", "caf\xC3\xA9 \"quoted\""}));
}

// Each bad line is named by its number.
TEST(Corpus, JsonLinesErrorsNameTheLine) {
  auto parse = [](const std::string& text) { return parse_text_jsonl(text, "in.jsonl"); };
  expect_input_error([&] { parse("{\"text\": \"a\"}\n[\"text\"]\n"); },
                     {"in.jsonl:2", "an object with a \"text\" string"});
  expect_input_error([&] { parse("\n{\"body\": \"a\"}"); }, {"in.jsonl:2", "\"text\" string"});
  expect_input_error([&] { parse("{\"text\": [\"a\"]}"); },
                     {"in.jsonl:1", "\"text\" must be a string, got array"});
  expect_input_error([&] { parse("{\"text\": \"a\"\n"); }, {"in.jsonl:1", "not valid JSON"});
  expect_input_error([&] { parse("{\"text\": \"a\", \"text\": \"b\"}"); },
                     {"in.jsonl:1", "key \"text\" appears twice"});
  expect_input_error([&] { parse(std::string("{\"text\": \"a\"}\0", 14)); },
                     {"in.jsonl:1", "NUL byte"});
  EXPECT_TRUE(parse("{\"text\": \"\"}\n\n").empty());
  TempDir dir;
  const std::string empty = dir.file("empty.jsonl");
  std::ofstream(empty) << "{\"text\": \"\"}\n";
  expect_input_error([&] { load_corpus("jsonl:" + empty); }, {empty, "no documents"});
}

TEST(Corpus, Errors) {
  TempDir dir;
  expect_input_error([] { load_corpus("shakespeare"); }, {"unknown corpus \"shakespeare\""});
  const std::string missing = dir.file("missing.txt");
  expect_input_error([&] { load_corpus("file:" + missing); }, {missing, "no such file"});
  const std::string blank = dir.file("blank.txt");
  std::ofstream(blank) << "\n  \n";
  expect_input_error([&] { load_corpus("file:" + blank); }, {blank, "no documents"});
  const std::string latin1 = dir.file("latin1.txt");
  std::ofstream(latin1) << "caf\xe9\n";
  expect_input_error([&] { load_corpus("file:" + latin1); }, {latin1, "UTF-8", "byte 3"});
}
