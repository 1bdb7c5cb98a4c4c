"""`RemoteEngine`: what the gateway uses of `engine.engine.Engine`, in a front process, over the link."""
