"""The engine's state: requests and sequences, the scheduler, the KV block manager, the output processor, the
detokenizer, the configuration and the metrics."""
