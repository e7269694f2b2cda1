//! Embedding gather: `out[t] = table[ids[t]]`. The backward scatters
//! (`dtable[ids[t]] += dout[t]`, accumulating).

use crate::{Error, Result};

/// `out[n, c] = table[ids[n], c]`. Ids must be < vocab; an out-of-range id is an error.
pub fn embedding_forward(
    out: &mut [f32],
    ids: &[u32],
    table: &[f32],
    vocab: usize,
    c: usize,
) -> Result<()> {
    if out.len() != ids.len() * c || table.len() != vocab * c {
        return Err(Error::Shape(format!(
            "embedding: out {} / table {} do not fit {} ids x {c} channels, vocab {vocab}",
            out.len(),
            table.len(),
            ids.len()
        )));
    }
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= vocab {
            return Err(Error::Index(format!(
                "token id {id} at position {t} is not below the vocabulary size {vocab}"
            )));
        }
        out[t * c..(t + 1) * c].copy_from_slice(&table[id * c..(id + 1) * c]);
    }
    Ok(())
}

/// Backward of [`embedding_forward`]: `dtable[ids[t]] += dout[t]` (accumulates;
/// repeated ids add up).
pub fn embedding_backward(
    dtable: &mut [f32],
    dout: &[f32],
    ids: &[u32],
    vocab: usize,
    c: usize,
) -> Result<()> {
    if dout.len() != ids.len() * c || dtable.len() != vocab * c {
        return Err(Error::Shape(format!(
            "embedding_backward: dout {} / dtable {} do not fit {} ids x {c} channels, vocab {vocab}",
            dout.len(),
            dtable.len(),
            ids.len()
        )));
    }
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= vocab {
            return Err(Error::Index(format!(
                "token id {id} at position {t} is not below the vocabulary size {vocab}"
            )));
        }
        for (d, g) in dtable[id * c..(id + 1) * c]
            .iter_mut()
            .zip(&dout[t * c..(t + 1) * c])
        {
            *d += g;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_rows_and_rejects_bad_ids() {
        let table = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let mut out = [0.0; 4];
        embedding_forward(&mut out, &[2, 0], &table, 3, 2).unwrap();
        assert_eq!(out, [20.0, 21.0, 0.0, 1.0]);
        assert!(embedding_forward(&mut out, &[3, 0], &table, 3, 2).is_err());
    }

    #[test]
    fn backward_scatters_and_accumulates() {
        let mut dtable = [1.0; 6];
        embedding_backward(
            &mut dtable,
            &[0.5, 1.0, 2.0, 3.0, 4.0, 5.0],
            &[2, 0, 2],
            3,
            2,
        )
        .unwrap();
        assert_eq!(dtable, [3.0, 4.0, 1.0, 1.0, 5.5, 7.0]);
        assert!(embedding_backward(&mut dtable, &[0.0; 2], &[3], 3, 2).is_err());
    }
}
