"""The torch worker: the decoder model, the preallocated K/V store, one model call over a
ragged batch, re-execution of journaled appends, model loading and the serving
loop whose every state change goes through the engine's command port."""
