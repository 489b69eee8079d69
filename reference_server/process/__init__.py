"""The engine in a process of its own (`phaselens serve --engine process`): the API process's client,
the engine process's main, the frames between them."""
