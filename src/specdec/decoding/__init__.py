"""The decoding algorithm, pure: no Triton import, no model; torch tensors in, tokens out.

  loop               propose -> verify -> accept, one round per target forward (`generate`)
  interfaces         Proposal, Scores, ForwardStats and the Proposer / Scorer protocols the loop calls
  rejection_sampler  the accept/reject rule (greedy and lossless stochastic), pure tensor functions
  sampling           logits -> probabilities (temperature, top-k, top-p), sampling, seeded generators
  draft_length       how many tokens to draft each round: the expected-speedup rule over measured costs
  ngram_proposer     prompt lookup: a Proposer with no model
  suffix_proposer    prompt lookup also over earlier requests' text: a cache they share
  text               tokenizer loading, incremental detokenization, stop words

May import: torch, `specdec.tensor_names`, and (text only, lazily) transformers' tokenizers.
"""
