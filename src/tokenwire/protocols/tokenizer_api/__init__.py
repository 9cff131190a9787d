"""The tokenizer endpoints (issue 43) on the OpenAI API's port: POST /tokenize, /detokenize and
/apply-template, with llama-server's and vLLM's field names. core.py turns a parsed body into
the answer (sans-IO: a Tokenizer in, a dict out); routes.py serves them."""
