"""The four stages (Dynamo, AOTAutograd, Inductor, precompile) and the
variants they build."""
