"""The front's end of the link: `connect` and `FrontLink`."""
