"""`HostStore`: the host's store (`gateway.store.base.Store`) as a front sees it, over the link."""
