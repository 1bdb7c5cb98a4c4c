"""`EngineHost`: one started Engine and one Store served to gateway front processes over a unix socket."""
