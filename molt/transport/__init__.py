"""Moving data between ranks: the ZeroMQ wire, the dispatch codec, the controller's mailbox and the
payload stores (DESIGN sections 2.2, 2.5, 7)."""
