//! The store's lease verbs: a sandbox holds its image's layers from its create until it is
//! gone, so that garbage collection leaves them (the journal itself is `leases`).

use crate::{
    gc::empty_trash, hex_digest, leases::Lease, ImageError, ImageStore, ResolvedImage,
    MAX_HOLDER_LEN,
};

fn validate_holder(holder: &str) -> Result<(), ImageError> {
    let ok = !holder.is_empty()
        && holder.len() <= MAX_HOLDER_LEN
        && !holder.starts_with('.')
        && holder
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ImageError::InvalidHolder {
            holder: holder.to_owned(),
        })
    }
}

impl ImageStore {
    /// Records that `holder` (a sandbox) uses the image's layers, so they survive removal of the image
    /// until [`release`](Self::release). Re-leasing the same layers is a no-op; a holder can hold one
    /// image only. The `host` image has nothing to hold.
    pub fn lease(&self, holder: &str, image: &ResolvedImage) -> Result<(), ImageError> {
        validate_holder(holder)?;
        let ResolvedImage::Layers {
            name,
            layers,
            id,
            config,
        } = image
        else {
            return Ok(());
        };
        let layers_dir = self.layers_dir();
        let mut digests = Vec::with_capacity(layers.len());
        for path in layers {
            let hex = path
                .strip_prefix(&layers_dir)
                .ok()
                .and_then(|p| p.to_str())
                .filter(|h| hex_digest(&format!("sha256:{h}")).is_some())
                .ok_or_else(|| ImageError::NotFound { name: name.clone() })?;
            digests.push(format!("sha256:{hex}"));
        }
        let _lock = self.lock(true)?;
        // Resolve and lease are separate calls: the image may have been removed in between.
        if layers.iter().any(|p| !p.is_dir()) {
            return Err(ImageError::NotFound { name: name.clone() });
        }
        let lease = Lease {
            image: name.clone(),
            layers: digests,
            id: id.clone(),
            config: Some(config.clone()),
        };
        match self.leases.add(holder, lease.clone())? {
            Some(held) if held.layers != lease.layers => Err(ImageError::InUse {
                holder: holder.to_owned(),
            }),
            _ => Ok(()),
        }
    }

    /// The image `holder` leased, as it was when leased (`None` without a lease or for `host`).
    pub fn leased(&self, holder: &str) -> Result<Option<ResolvedImage>, ImageError> {
        validate_holder(holder)?;
        let _lock = self.lock(false)?;
        let Some(lease) = self.leases.read(|live| live.get(holder).cloned())? else {
            return Ok(None);
        };
        let Some(config) = lease.config else {
            return Ok(None);
        };
        let layers = lease
            .layers
            .iter()
            .filter_map(|d| hex_digest(d).map(|h| self.layers_dir().join(h)))
            .collect();
        Ok(Some(ResolvedImage::Layers {
            name: lease.image,
            id: lease.id,
            layers,
            config,
        }))
    }

    /// Drops `holder`'s lease (if any) and collects what it alone kept alive.
    pub fn release(&self, holder: &str) -> Result<(), ImageError> {
        validate_holder(holder)?;
        let trash = {
            let _lock = self.lock(true)?;
            let Some(lease) = self.leases.remove(holder)? else {
                return Ok(());
            };
            // An image that still has a name keeps its layers (an id is the hash of its layers
            // and config): nothing to collect, and no need to read every image's metadata.
            if !lease.id.is_empty() && self.read_names()?.names.values().any(|id| *id == lease.id) {
                return Ok(());
            }
            self.gc_locked()?
        };
        empty_trash(trash);
        Ok(())
    }
}
