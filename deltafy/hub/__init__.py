"""Publishing on the Hugging Face Hub: what a push sends and may send (plan), and the push itself (push).
The model card every checkpoint carries is deltafy.card's: deltafy.save writes it too."""
