"""Admission: which requests generate now, which wait, and in what order, across every orchestrator
instance of one server.

  sequence_slots  the live-sequence cap (max_live_sequences), held across instances with file locks
  kv_room         waiting for room in target_model's KV cache, by priority then first come first served
  ticket_line     the server-wide line both waits use: by priority, then first come first served
  verify_gate     concurrent requests' verify calls lined up into one target forward
  counts          this instance's live and queued requests, the one owner of those counts
  cancellation    the board through which an ensemble's cancellation reaches the orchestrator

May import: the standard library, `specdec.decoding` (the loop's interfaces). Never pb_utils: every
module here is unit-tested without a server.
"""
