"""The public texts of ``mechanism: answer``'s replies (what a client reads; the bench scores
against them): a released fact is stated as coming from the documents, and a reply without one
says, before anything else, that the documents gave no answer it can share; a public model answer
after it is marked as general knowledge, not from the documents."""

FROM_DOCUMENTS = "From the documents: {fact}."  # a released fact (the reply's first sentence)
NOT_FROM_DOCUMENTS = "The documents did not give an answer I can share."  # nothing released
GENERAL_KNOWLEDGE = "General knowledge, not from the documents:"  # before the public answer (on_empty: public)
