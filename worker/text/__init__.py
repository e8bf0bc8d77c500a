"""Text in and out of token ids: the tokenizer, the incremental detokenizer, and grammars.

`tokenizer` (Hugging Face `tokenizers` and the chat template, without `transformers`),
`detokenizer` (a request's text as its tokens come, with stop strings), `structured_output`
(a request's grammar through `llguidance`: which tokens it allows next).
"""
