"""Effects: pykka actors talking in msgspec messages."""
