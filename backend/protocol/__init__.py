"""Pure request parsing and validation, and the Triton wire contract: no torch, numpy or llguidance, so that the
front door and the client can import it without the engine's libraries."""
