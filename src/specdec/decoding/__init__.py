"""The decoding algorithm, pure: no Triton import, no model; torch tensors in, tokens out.

  loop               propose -> verify -> accept, one round per target forward (`generate`)
  interfaces         Proposal, VerifyCall, Scores, ForwardStats and the Proposer / Scorer protocols the loop calls
  rejection_sampler  the accept/reject rule (greedy and lossless stochastic), pure tensor functions
  tree_sampler       the same rule over a token tree: the greedy path, recursive rejection sampling over siblings; a tree's first branch
  draft_tree         a draft model's chain with its other candidates per position as a token tree
  features           the target's features a trained head has not read yet, cut to what each round keeps
  sampling           logits -> probabilities (temperature, top-k, top-p), sampling, seeded generators
  draft_length       how many tokens to draft each round: the expected-speedup rule over measured costs
  skip_search        which layers a layer-skip self-draft leaves out: a search scored by agreement and cost
  penalties          repetition, presence and frequency penalties on the target's logits
  bad_words          token sequences the output never contains
  logit_bias         logit_bias and allowed_token_ids (vLLM's and OpenAI's token-level settings)
  grammar            structured output: a grammar's mask per position and its forced text, exact under speculation
  structural_tags    structural tags (vLLM's structures, xgrammar's format tree) as one Lark grammar
  thinking           a reasoning model's thinking in token ids: a grammar applied to the answer after it
  token_mask         allowed-token bitmasks read where the logits are
  ngram_proposer     prompt lookup: a Proposer with no model
  suffix_proposer    prompt lookup also over earlier requests' text: a cache they share
  lookup_first       prompt lookup first, a draft model where it finds no long enough match ("ngram+NAME")
  prediction_proposer  OpenAI's Predicted Outputs: a request's expected answer as its draft
  text               tokenizer loading, incremental detokenization, stop words
  generation_config  a model's generation_config.json: the tokens that end its answers, its sampling defaults
  json_text          JSON from a client or a model read with one way to fail (ValueError, deep nesting included)

May import: torch, `specdec.tensor_names`, and (text only, lazily) transformers' tokenizers.
"""
